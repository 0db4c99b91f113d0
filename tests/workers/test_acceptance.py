"""Speculative acceptance rules: greedy is exact; rejection sampling preserves the target."""

from __future__ import annotations

import pytest
import torch

from workers.spec.acceptance import accept_greedy, accept_rejection


def test_greedy_accepts_the_matching_run():
    logits = torch.full((4, 6), -1.0)
    for row, tok in enumerate([2, 5, 1, 3]):
        logits[row, tok] = 1.0
    assert accept_greedy(logits, [2, 5, 0]).token_ids == [2, 5, 1]
    assert accept_greedy(logits, [2, 5, 1]).token_ids == [2, 5, 1, 3]
    assert accept_greedy(logits, [4, 5, 1]).num_accepted == 0
    assert accept_greedy(logits[:1], []).token_ids == [2]


def _first_token_distribution(p: torch.Tensor, q: torch.Tensor, samples: int) -> torch.Tensor:
    """Empirical distribution of the first emitted token, one draft drawn from q."""
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(p.shape[0])
    drafts = torch.multinomial(q.expand(samples, -1), 1, replacement=True, generator=gen).view(-1).tolist()
    target = torch.stack([p, p])
    draft_probs = q.view(1, -1)
    for d in drafts:
        counts[accept_rejection(target, [d], draft_probs, gen).token_ids[0]] += 1
    return counts / samples


@pytest.mark.parametrize("case", ["equal", "disjoint", "one_hot", "skewed"])
def test_rejection_sampling_preserves_target(case):
    v = 6
    p = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.07, 0.03])
    q = {
        "equal": p.clone(),
        "disjoint": torch.tensor([0.0, 0.0, 0.0, 0.0, 0.5, 0.5]),
        "one_hot": torch.nn.functional.one_hot(torch.tensor(3), v).float(),
        "skewed": torch.tensor([0.02, 0.03, 0.05, 0.1, 0.3, 0.5]),
    }[case]
    got = _first_token_distribution(p, q, 100_000)
    tv = 0.5 * (got - p).abs().sum().item()
    assert tv <= 0.01, (case, tv, got)


def test_rejection_with_one_hot_target_never_emits_other_tokens():
    p = torch.nn.functional.one_hot(torch.tensor(2), 5).float()
    q = torch.full((5,), 0.2)
    gen = torch.Generator().manual_seed(1)
    for d in range(5):
        out = accept_rejection(torch.stack([p, p]), [d], q.view(1, -1), gen)
        assert out.token_ids[0] == 2 and out.num_accepted == int(d == 2)
