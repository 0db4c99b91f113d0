"""Logits processors and filters as tensor ops over every row of a step at once.

Each function takes float32 logits ``[R, V]`` and the step's ``SamplingInputs`` pieces
and returns (or edits in place) processed logits; none loops over requests or syncs.
The definitions follow transformers' processors of the same names (the tests compare
with them on the same logits): ``SequenceBiasLogitsProcessor`` (logit_bias),
``NoBadWordsLogitsProcessor``, ``MinNewTokensLengthLogitsProcessor``,
``RepetitionPenaltyLogitsProcessor``, ``TemperatureLogitsWarper``, ``TopKLogitsWarper``,
``TopPLogitsWarper``, ``MinPLogitsWarper``; frequency and presence penalties follow
OpenAI's definition (transformers has none).
"""

from __future__ import annotations

import torch

from workers.sampling.inputs import BadWordInputs, RowFilters, RowTokens

NEG_INF = float("-inf")


def add_bias(logits: torch.Tensor, bias: RowTokens) -> None:
    """logits[row, token] += value, for every pair (OpenAI logit_bias)."""
    assert bias.values is not None
    logits.index_put_((bias.rows, bias.tokens), bias.values, accumulate=True)


def block_tokens(logits: torch.Tensor, blocked: RowTokens) -> None:
    """EOS and stop tokens of rows below min_tokens can not be sampled."""
    logits[blocked.rows, blocked.tokens] = NEG_INF


def ban_bad_words(logits: torch.Tensor, words: BadWordInputs, input_ids: torch.Tensor) -> None:
    """Ban a word's last token where the tokens before the row end with the rest of it."""
    tokens = torch.cat([input_ids, words.history.to(input_ids.dtype)])[words.gather]  # [P, W]
    match = ((tokens == words.prefix) | (words.prefix < 0)).all(dim=-1)
    # -inf added where a pair matches, 0 where not: no host-side filtering, no sync.
    ban = torch.zeros(match.shape, dtype=logits.dtype, device=logits.device).masked_fill(match, NEG_INF)
    logits.index_put_((words.rows, words.banned), ban, accumulate=True)


def apply_penalties(
    logits: torch.Tensor,
    rows: torch.Tensor,
    seen: torch.Tensor,
    counts: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> None:
    """Rows ``rows`` of logits; ``seen`` (bool [P, V]: in the prompt or output) and
    ``counts`` (int [P, V]: output occurrences) as of each row."""
    x = logits[rows]
    rep = repetition[:, None]
    repeated = torch.where(x > 0, x / rep, x * rep)
    x = torch.where(seen | (counts > 0), repeated, x)
    x = x - frequency[:, None] * counts - presence[:, None] * (counts > 0)
    logits[rows] = x


def filter_rows(logits: torch.Tensor, f: RowFilters) -> torch.Tensor:
    """Temperature, then top-k, top-p, min-p (transformers' warper order), per row.

    Returns new scaled, masked logits; greedy rows are scaled by 1 and left unfiltered.
    """
    x = logits / f.temperature[:, None]
    sampled = ~f.greedy[:, None]
    if f.top_k is not None or f.top_p is not None:
        x = _top_k_top_p(x, f.top_k, f.top_p, sampled)
    if f.min_p is not None:
        probs = torch.softmax(x, dim=-1)
        floor = f.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        x = x.masked_fill((probs < floor) & sampled, NEG_INF)
    return x


def _top_k_top_p(
    x: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, sampled: torch.Tensor
) -> torch.Tensor:
    vocab = x.shape[-1]
    ordered, order = torch.sort(x, dim=-1, descending=True)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        kth = ordered.gather(1, (k - 1)[:, None])
        x = x.masked_fill((x < kth) & sampled, NEG_INF)
        ordered = ordered.masked_fill(ordered < kth, NEG_INF)
    if top_p is not None:
        probs = torch.softmax(ordered, dim=-1)
        # A token goes when the mass before it reaches top_p; the top token always stays
        # (a top_p that rounds to 0 would otherwise mask every token).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p[:, None]
        drop[:, 0] = False
        drop_v = torch.zeros_like(drop).scatter_(1, order, drop)
        x = x.masked_fill(drop_v & sampled, NEG_INF)
    return x


def draw(
    probs: torch.Tensor, shared: torch.Generator | None, seeded: list[tuple[int, torch.Generator, int | None]]
) -> torch.Tensor:
    """One token per row from ``probs`` (exponential race: argmax p / E, E ~ Exp(1)).

    Unseeded rows draw their noise from ``shared`` in one call; a seeded row's entry
    ``(row, generator, key)`` refills it from its generator, re-seeded with ``key``
    (``workers.sampling.seeded.position_seed``) or, for None, as the generator stands. Either
    way its token does not depend on the rest of the batch.
    """
    noise = torch.empty_like(probs)
    if len(seeded) < probs.shape[0]:  # some row is unseeded
        noise.exponential_(generator=shared)
    for row, gen, key in seeded:
        if key is not None:
            gen.manual_seed(key)
        noise[row].exponential_(generator=gen)
    return (probs / noise).argmax(dim=-1)
