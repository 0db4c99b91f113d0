"""What a request's sampling needs beyond its params, resolved once when it is added."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workers.sampling.params import SamplingParams


@dataclass(frozen=True)
class RequestSampling:
    blocked_ids: tuple[int, ...]  # blocked while fewer than min_tokens outputs
    bad_words_ids: tuple[tuple[int, ...], ...]  # token sequences never to complete
    # No processor, no logprobs of any kind: its rows are temperature / top-k / top-p /
    # min-p alone (``SamplingPlanner``'s fast path).
    plain: bool = False


def request_sampling(params: SamplingParams, eos_token_id: int | None, tokenizer: Any) -> RequestSampling:
    blocked: tuple[int, ...] = ()
    if params.min_tokens > 0:
        stops = list(params.stop_token_ids)
        if eos_token_id is not None and not params.ignore_eos:
            stops.append(eos_token_id)
        blocked = tuple(dict.fromkeys(stops))
    words = bad_words_token_ids(params.bad_words, tokenizer) if params.bad_words else ()
    plain = not (
        params.logit_bias
        or params.uses_penalties
        or params.bad_words
        or params.min_tokens
        or params.structured_output is not None
        or params.needs_logprobs
        or params.prompt_logprobs is not None
    )
    return RequestSampling(blocked, words, plain)


def bad_words_token_ids(words: tuple[str, ...], tokenizer: Any) -> tuple[tuple[int, ...], ...]:
    """Each word as it is tokenized at the start of a text and after a space.

    Byte-level BPE gives a word a different first token after a space, so both forms
    are banned (vLLM bans both too); duplicates collapse.
    """
    out: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids:
                out[ids] = None
    return tuple(out)
