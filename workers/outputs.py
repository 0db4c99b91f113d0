"""What the engine hands back: cumulative state of a request plus this step's delta."""

from __future__ import annotations

from dataclasses import dataclass

from workers.request import TokenLogprob


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all generated tokens so far
    text: str  # all generated text so far (stop string cut)
    cached_tokens: int  # prompt tokens served from the prefix cache
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    stop_reason: str | int | None  # the stop string / token that ended it
    new_token_ids: list[int]  # tokens added by this step
    delta_text: str  # text safe to stream since the last output
    logprobs: list[TokenLogprob] | None  # per generated token, when asked for
    prompt: str | None = None
    # Per prompt position when asked (entry 0 is None); complete once the prefill is done.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cumulative_logprob: float | None = None  # sum of the chosen tokens' logprobs (logprobs / best_of)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(slots=True)
class EngineOutput:
    """What ``Engine.step`` hands back per request with news: token ids, never text.

    Detokenization, stop strings and ``RequestOutput``s are the front-end's
    (``workers.output_processor``), off the engine's thread. ``new_logprobs`` are the
    chosen-token entries of ``new_token_ids`` when the request needs logprobs (asked for,
    or to rank ``best_of``); ``prompt_logprobs`` come once, with the request's first
    tokens (or its end, if it ends before any). ``stop_reason`` is a stop token id.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None
    stop_reason: int | None
    cached_tokens: int
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(slots=True)
class OutputDelta:
    """One request's news for a consumer (a stream): what ``new_token_ids`` added, as text
    safe to send (held back while it could still start a stop string), with their
    logprobs when asked for; ``prompt_logprobs`` once, on the first delta."""

    request_id: str
    new_token_ids: list[int]
    delta_text: str
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None
    cached_tokens: int
    cumulative_logprob: float | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
