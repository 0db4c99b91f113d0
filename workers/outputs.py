"""What the engine hands back: cumulative state of a request plus this step's delta."""
from __future__ import annotations

from dataclasses import dataclass

from workers.request import TokenLogprob


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]                  # all generated tokens so far
    text: str                             # all generated text so far (stop string cut)
    cached_tokens: int                    # prompt tokens served from the prefix cache
    finished: bool
    finish_reason: str | None             # "stop" | "length" | "abort" | None
    stop_reason: str | int | None         # the stop string / token that ended it
    new_token_ids: list[int]              # tokens added by this step
    delta_text: str                       # text safe to stream since the last output
    logprobs: list[TokenLogprob] | None   # per generated token, when asked for
    prompt: str | None = None
    # Per prompt position when asked (entry 0 is None); complete once the prefill is done.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cumulative_logprob: float | None = None   # sum of the chosen tokens' logprobs (logprobs / best_of)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
