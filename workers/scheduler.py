"""Continuous batching with chunked prefill, mixed batches and preemption by recompute.

Pure bookkeeping: ints and lists, no tensors. One call to ``schedule`` decides one step:

1. Running requests, oldest first, each get the tokens they lack (one for a decode, a
   chunk of at most ``chunked_prefill_size`` for a prefill), within ``max_batch_tokens``.
   KV pages for those tokens are allocated now; when the page pool is empty the youngest
   running request is preempted (its pages and slot freed, ``num_computed_tokens`` reset
   to 0, back to the front of the queue) until the allocation fits.
2. Waiting requests are admitted in FIFO order while a Mamba slot, pages and budget exist
   and fewer than ``max_running_requests`` run. Admission never preempts.

Invariant: after ``schedule``, every running request holds a live slot and exactly
``ceil((num_computed_tokens + num_new_tokens) / page_size)`` pages (pages for tokens it
is about to compute included).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from configs.schema import SchedulerConfig
from workers.allocators import IdAllocator
from workers.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledSeq:
    """One request's share of a step: compute tokens ``[start, start + num_new_tokens)``."""

    request: Request
    start: int
    num_new_tokens: int
    samples: bool          # the chunk reaches the end of the known tokens: sample after it

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens


@dataclass(frozen=True)
class ScheduledBatch:
    batch_id: int
    seqs: tuple[ScheduledSeq, ...]
    preempted: tuple[Request, ...]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class Scheduler:
    def __init__(self, config: SchedulerConfig, page_size: int, pages: IdAllocator,
                 slots: IdAllocator, max_model_len: int) -> None:
        self.config = config
        self.page_size = page_size
        self.pages = pages
        self.slots = slots
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._next_batch_id = 0
        self.num_preemptions = 0

    # -- queue management -------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def release(self, request: Request) -> None:
        """Free a request's pages and slot and drop it from the queues."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._free_resources(request)

    def _free_resources(self, request: Request) -> None:
        if request.page_ids:
            self.pages.free(request.page_ids)
            request.page_ids = []
        if request.mamba_slot is not None:
            self.slots.free([request.mamba_slot])
            request.mamba_slot = None

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._free_resources(request)
        request.num_computed_tokens = 0
        request.num_cached_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # -- one step ----------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        budget = self.config.max_batch_tokens
        seqs: list[ScheduledSeq] = []
        preempted: list[Request] = []
        for request in list(self.running):
            if request not in self.running:      # preempted earlier in this loop
                continue
            n = self._num_to_compute(request, budget)
            if n == 0:
                continue
            if not self._grow_pages(request, n, preempted):
                continue
            seqs.append(self._scheduled(request, n))
            budget -= n
        self._admit(budget, seqs)
        if not seqs:
            return None
        batch = ScheduledBatch(self._next_batch_id, tuple(seqs), tuple(preempted))
        self._next_batch_id += 1
        return batch

    def _num_to_compute(self, request: Request, budget: int) -> int:
        missing = request.num_tokens - request.num_computed_tokens
        return max(0, min(missing, self.config.chunked_prefill_size, budget))

    def _scheduled(self, request: Request, n: int) -> ScheduledSeq:
        start = request.num_computed_tokens
        return ScheduledSeq(request, start, n, samples=start + n == request.num_tokens)

    def _grow_pages(self, request: Request, n: int, preempted: list[Request]) -> bool:
        """Give ``request`` pages for ``n`` more tokens, preempting the youngest if needed.

        Returns False when ``request`` itself had to be preempted.
        """
        need = pages_needed(request.num_computed_tokens + n, self.page_size) - len(request.page_ids)
        while not self.pages.can_alloc(need):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        new = self.pages.alloc(need)
        assert new is not None
        request.page_ids.extend(new)
        return True

    def _admit(self, budget: int, seqs: list[ScheduledSeq]) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running_requests:
            request = self.waiting[0]
            n = self._num_to_compute(request, budget)
            need = pages_needed(request.num_computed_tokens + n, self.page_size) - len(request.page_ids)
            if not self.pages.can_alloc(need) or not self.slots.can_alloc(1):
                break
            self.waiting.popleft()
            request.page_ids.extend(self.pages.alloc(need) or [])
            request.mamba_slot = self.slots.alloc_one()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            seqs.append(self._scheduled(request, n))
            budget -= n
