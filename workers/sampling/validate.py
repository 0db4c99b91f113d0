"""Checks of SamplingParams that need the model (vocabulary) or the engine's features."""
from __future__ import annotations

from workers.sampling_params import SamplingParams

# Fields accepted by SamplingParams whose engine side is not built yet: refused, never ignored.
_NOT_YET: tuple[tuple[str, object], ...] = (
    ("min_p", 0.0), ("prompt_logprobs", None), ("repetition_penalty", 1.0),
    ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("logit_bias", ()),
    ("bad_words", ()), ("best_of", None), ("structured_output", None),
    ("skip_special_tokens", True),
)


def check_params(params: SamplingParams, vocab_size: int) -> None:
    """Raise ValueError naming the first value the engine cannot honour."""
    for name, default in _NOT_YET:
        if getattr(params, name) != default:
            raise ValueError(f"{name}={getattr(params, name)!r} is not supported by this engine yet")
    bad = [t for t, _ in params.logit_bias if t >= vocab_size]
    if bad:
        raise ValueError(f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise ValueError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
