"""Log-probabilities of chosen tokens and prompt tokens, from the model's raw logits."""

from __future__ import annotations

from collections.abc import Callable

import torch

from workers.request import TokenLogprob
from workers.sampling.inputs import PromptInputs

PROMPT_BLOCK_ROWS = 256  # prompt rows per logits block: bounds the [rows, V] temporaries


def token_logprobs(raw: torch.Tensor, tokens: torch.Tensor, num_top: int) -> list[TokenLogprob]:
    """raw: float [N, V] logits; tokens: int64 [N] the token scored at each row."""
    lps = torch.log_softmax(raw.float(), dim=-1)
    chosen = lps.gather(1, tokens.view(-1, 1)).view(-1)
    rank = (lps > chosen[:, None]).sum(dim=-1) + 1
    top = torch.topk(lps, max(num_top, 1), dim=-1)
    ids, values = top.indices[:, :num_top].tolist(), top.values[:, :num_top].tolist()
    return [
        TokenLogprob(t, c, list(zip(i, v)), r)
        for t, c, r, i, v in zip(tokens.tolist(), chosen.tolist(), rank.tolist(), ids, values)
    ]


def prompt_logprobs(
    p: PromptInputs, hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor]
) -> list[tuple[int, int, list[TokenLogprob]]]:
    """Per sequence that asked: (batch index, first prompt position scored, entries)."""
    num_top = max(k for _, _, _, k in p.seqs)
    entries: list[TokenLogprob] = []
    for lo in range(0, int(p.hidden_rows.shape[0]), PROMPT_BLOCK_ROWS):
        rows = p.hidden_rows[lo : lo + PROMPT_BLOCK_ROWS]
        entries += token_logprobs(compute_logits(hidden[rows]), p.targets[lo : lo + PROMPT_BLOCK_ROWS], num_top)
    out, at = [], 0
    for b, first, count, k in p.seqs:
        block = entries[at : at + count]
        at += count
        out.append((b, first, [TokenLogprob(e.token_id, e.logprob, e.top[:k], e.rank) for e in block]))
    return out
