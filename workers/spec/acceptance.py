"""Accepting drafted tokens against the target model (pure functions over tensors).

Greedy: drafts are accepted while each equals the target's argmax; the target's argmax at
the first mismatch (or after the last draft) is the bonus token. Output equals plain greedy
decoding exactly.

Rejection sampling (Leviathan et al. / Chen et al.): draft i, drawn from q_i, is accepted
with probability min(1, p_i(d) / q_i(d)); at the first rejection the token is drawn from
norm(max(0, p_i - q_i)); if every draft is accepted the bonus is drawn from p_k. The
output tokens are then distributed exactly as sampling from p alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Accepted:
    num_accepted: int  # drafts accepted (0 .. k)
    token_ids: list[int]  # accepted drafts + one token from the target (num_accepted + 1)


def accept_greedy(target_logits: torch.Tensor, draft_ids: list[int]) -> Accepted:
    """target_logits: [k + 1, V] for the verify rows; draft_ids: the k drafts."""
    return accept_greedy_ids(target_logits.argmax(dim=-1).tolist(), draft_ids)


def accept_greedy_ids(best: list[int], draft_ids: list[int]) -> Accepted:
    """best: the target's argmax at each of the k + 1 verify rows (host ints)."""
    n = 0
    while n < len(draft_ids) and draft_ids[n] == best[n]:
        n += 1
    return Accepted(n, draft_ids[:n] + [best[n]])


def accept_rejection(
    target_probs: torch.Tensor, draft_ids: list[int], draft_probs: torch.Tensor, generator: torch.Generator | None
) -> Accepted:
    """target_probs: [k + 1, V]; draft_probs: [k, V] (the q each draft was drawn from)."""
    k = len(draft_ids)
    uniforms = torch.rand(k, generator=generator, device=target_probs.device).tolist() if k else []
    for i, d in enumerate(draft_ids):
        p, q = float(target_probs[i, d]), float(draft_probs[i, d])
        if p > 0 and q > 0 and uniforms[i] * q <= p:  # p = 0: a token the processors banned
            continue
        residual = (target_probs[i] - draft_probs[i]).clamp_min(0)
        if float(residual.sum()) <= 0:
            residual = target_probs[i]
        token = int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
        return Accepted(i, draft_ids[:i] + [token])
    bonus = int(torch.multinomial(target_probs[k], 1, generator=generator))
    return Accepted(k, draft_ids + [bonus])
