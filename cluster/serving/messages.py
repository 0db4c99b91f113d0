"""What the ingress and an ``EngineReplica`` send each other (pickled across Ray).

One ``GenerateRequest`` carries ONE prompt and the SamplingParams of its ``n`` choices,
so every choice of a prompt lands on the same replica (they share its prefix). The router
reads ``prompt_token_ids`` from the request, which is why the ingress tokenizes.

The replica's ``generate`` stream yields, in order:
1. exactly one of ``Accepted`` (every choice was queued) or a ``GenerateError`` (the
   engine refused the input; nothing was queued, nothing stays allocated);
2. then lists of ``GenerateChunk`` (per-step deltas, several coalesced when the consumer
   is slower than the engine) until every choice has sent ``finished=True``;
3. for a ``prefill_only`` request some choice of which finished with ``handoff``: one
   ``Handoff``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from workers.request import TokenLogprob
from workers.sampling.params import SamplingParams


@dataclass(frozen=True)
class GenerateRequest:
    """``output_prefixes``: per choice, output tokens already sent to the client (a stream
    resumed on another replica, ``cluster/api/resume.py``; a prefill/decode hand-off,
    ``cluster/pd``): ``Engine.add_request``'s ``output_prefix`` -- counted as the choice's
    first outputs, replayed through its detokenizer, not sent again. ``prefill_only``: run
    each choice to its first token, then end the stream with a ``Handoff``. ``handoff``:
    the ``HandoffTicket`` of the prompt's checkpoint, pulled before the choices are queued."""

    request_id: str  # unique per prompt; choice j runs as f"{id}-{j}"
    prompt_token_ids: list[int]
    params: list[SamplingParams]  # one per choice (n of them)
    prompt: str = ""  # the prompt text when known (for text-based routers)
    output_prefixes: tuple[tuple[int, ...], ...] = ()
    prefill_only: bool = False
    handoff: Any = None

    def __post_init__(self) -> None:
        if self.output_prefixes and len(self.output_prefixes) != len(self.params):
            raise ValueError(f"{len(self.output_prefixes)} output_prefixes for {len(self.params)} choices")

    @property
    def num_choices(self) -> int:
        return len(self.params)

    def longest_sequence(self) -> list[int]:
        """The prompt and the longest output prefix: how far a cached state can serve it."""
        return self.prompt_token_ids + list(max(self.output_prefixes, key=len, default=()))


@dataclass(frozen=True)
class GenerateChunk:
    """The delta of one choice produced by one engine step."""

    index: int  # choice index within the GenerateRequest
    new_token_ids: list[int]
    delta_text: str
    logprobs: list[TokenLogprob] | None  # for new_token_ids, when asked for
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None
    cached_tokens: int
    prompt_logprobs: list[TokenLogprob | None] | None = None  # once, on the choice's first chunk
    cumulative_logprob: float | None = None  # of the tokens so far (logprobs / best_of)


@dataclass(frozen=True)
class Accepted:
    """First stream item: every choice of the request is queued in the engine."""

    num_choices: int


@dataclass(frozen=True)
class Handoff:
    """Last item of a ``prefill_only`` stream whose choices go on: the ticket of the prompt's
    checkpoint (None when the prefill replica holds none: the decode replica computes it)."""

    ticket: Any


@dataclass(frozen=True)
class GenerateError:
    """The engine refused the request (bad input); maps to an HTTP 400."""

    message: str
    param: str | None = None


@dataclass(frozen=True)
class ModelInfo:
    max_model_len: int
    vocab_size: int
    model_dir: str


@dataclass(frozen=True)
class ReplicaStats:
    """What ``EngineReplica.stats`` returns (also the ``/debug/replicas`` entries)."""

    replica_id: str
    replica_label: str
    num_streams: int  # open generate streams on this replica
    has_unfinished: bool  # the engine still holds requests
    pools: dict[str, int]  # free/used/usable KV pages and Mamba slots
    counters: dict[str, object] = field(default_factory=dict)  # EngineStats.snapshot()
    node_id: str = ""  # the Ray node the replica runs on (empty without Ray)
    loop: dict[str, float] = field(default_factory=dict)  # EngineLoop.times: steps, step wall and CPU s
    pid: int = 0  # the replica's process (per-process CPU in the hop bench)
