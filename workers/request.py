"""A request in the ``num_tokens`` / ``num_computed_tokens`` form (DESIGN §4).

Each step the scheduler gives a request tokens to catch up: ``all_token_ids[
num_computed_tokens : num_computed_tokens + n]``. A prefill chunk, a decode token and a
recompute after preemption are all that one rule. The request holds ids of pool
entries (KV pages, its live Mamba slot) but never tensors.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from workers.sampling.params import SamplingParams
from workers.sampling.requests import RequestSampling


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop string or a stop token
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # cancelled by the caller


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first
    rank: int | None = None  # 1 + the number of tokens more likely than token_id (prompt logprobs)


@dataclass
class RequestCacheState:
    """A request's share of the prefix cache (ints and a tree node; no tensors).

    - ``page_ids[:num_tree_pages]`` (on the Request) belong to the tree and are protected
      by the lock on ``locked_node``; the rest are the request's own.
    - ``keep_slot`` holds H(``keep_depth``) when ``keep_depth`` is set (I4: the label is the
      depth of the state actually in the slot, taken from the ledger's content record of
      the write that produced it; None = nothing unpublished).
    - ``next_slot`` (extra_buffer) / ``pending_slot`` (extra_buffer_lazy) is where the next
      checkpoint is written; ``targets`` are prefill checkpoint depths still to reach.
    - ``cow_src`` is a tree checkpoint slot to copy into the live slot before the next
      forward (a prefix hit); the lock on ``locked_node`` keeps it alive until then.
    - ``promotion``: a pending host -> device copy of a deeper checkpoint into the live (and
      keep) slot (``workers/tiers/promotion.py``); the request gets no work until it ends.
    """

    num_tree_pages: int = 0
    locked_node: object | None = None
    keep_slot: int | None = None
    keep_depth: int | None = None
    keep_phase: str = "prefill"
    keep_batch: int = -1
    next_slot: int | None = None
    pending_slot: int | None = None
    targets: list[int] = field(default_factory=list)
    cow_src: int | None = None
    promotion: object | None = None


@dataclass(eq=False)
class Request:
    """``request_id`` is the caller's name; ``handle`` is the engine's (unique for the engine's
    lifetime, increasing in arrival order): every internal map (slot ledger, generators) is
    keyed by the handle, so a caller may reuse an id while the old request's resources are
    still being released. Requests compare and hash by identity (``eq=False``): a
    field-by-field ``__eq__`` made every membership test cost the whole request."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    handle: int = 0
    eos_token_id: int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    # the first outputs were generated elsewhere and given at add (a prefill/decode hand-off)
    num_resumed_outputs: int = 0
    # Per prompt position (entry 0 is None: nothing scores the first token); filled as
    # prefill chunks are processed when params.prompt_logprobs is set, else empty.
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    sampling: RequestSampling | None = None  # resolved at add (bad-word ids, blocked ids)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    lookup_counted: bool = False  # the first prefix lookup has been counted
    prompt_counted: bool = False  # the prompt's tokens have been counted once
    prompt_sent: bool = False  # its prompt logprobs went out with an output
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    page_ids: list[int] = field(default_factory=list)
    page_epoch: int = 0  # bumped whenever page_ids changes other than by appending
    mamba_slot: int | None = None
    num_pending_tokens: int = 0  # tokens that launched, unprocessed batches will append
    inflight_batch: int | None = None  # newest launched, unprocessed batch holding this request
    num_inflight_verifies: int = 0  # launched verifies whose acceptance is not processed yet
    inflight_verify_drafts: int = 0  # drafts of the newest of them (how far it may move the next)
    has_drafts: bool = False  # the MTP head drafted after this request's last sample
    cache: RequestCacheState = field(default_factory=lambda: RequestCacheState())
    num_preemptions: int = 0
    num_bypassed: int = 0  # younger requests admitted while it waited (lpm's bound)
    first_token_time: float | None = None
    finished_time: float | None = None

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None and not self.prompt_logprobs:
            self.prompt_logprobs = [None]

    @property
    def max_cached_prefix(self) -> int:
        """Tokens a prefix-cache hit may cover. A request still missing prompt logprobs
        needs the logits of those positions, so its hit stops where they start (cold,
        at first); the cache is not read past it, while its checkpoints are still written."""
        limit = self.num_tokens - 1
        missing = self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens
        return min(limit, len(self.prompt_logprobs) - 1) if missing else limit

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_expected_tokens(self) -> int:
        """Known tokens plus those in-flight batches are sampling (what scheduling sees)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, pos: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[pos] if pos < n else self.output_token_ids[pos - n]

    def token_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        head = self.prompt_token_ids[start:n] if start < n else []
        return head + self.output_token_ids[max(start - n, 0) : end - n]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
