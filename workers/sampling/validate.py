"""Checks of SamplingParams that need the model (its vocabulary)."""

from __future__ import annotations

from workers.sampling.params import SamplingParams


def check_params(params: SamplingParams, vocab_size: int) -> None:
    """Raise ValueError naming the first token id outside the vocabulary."""
    for name, ids in (
        ("logit_bias", [t for t, _ in params.logit_bias]),
        ("stop_token_ids", list(params.stop_token_ids)),
    ):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise ValueError(f"{name} token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
