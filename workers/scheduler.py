"""Continuous batching with chunked prefill, mixed batches and preemption by recompute.

Pure bookkeeping: ints and lists, no tensors. One call to ``schedule`` decides one step:

1. Running requests, oldest first, each get the tokens they lack (one for a decode, a
   chunk of at most ``chunked_prefill_size`` for a prefill), within ``max_batch_tokens``.
   A prefill chunk holds at most one checkpoint target (it is cut at the first of two);
   the kernels snapshot the state at the target's position inside the chunk, so the state at
   that depth exists at the end of a forward. KV pages for the new tokens are allocated
   now (evicting unlocked cached prefixes first); when that still fails, the youngest
   running request is preempted (resources freed, ``num_computed_tokens`` reset to 0,
   back into the queue at its arrival position) until the allocation fits.
2. Waiting requests are admitted while a live Mamba slot, pages and budget exist and
   fewer than ``max_running_requests`` run, in the order of ``scheduler.policy``: ``fcfs``
   (arrival order) or ``lpm`` (the longest cached prefix first, ``_next_waiting``).
   Admission may reuse a cached prefix and never preempts; it stops at the first request
   the policy picks that does not fit, and is skipped in a step that preempted or stalled
   a request.

Fairness under ``lpm``: every admission of a younger request counts one bypass against
each older waiting request; the oldest waiting request bypassed ``lpm_max_bypass`` times
is picked next (and stays picked until it is admitted). A request is therefore admitted
after at most ``lpm_max_bypass`` younger ones (plus those older than it): no starvation.
``waiting`` stays in arrival order (a preempted request goes back to its place); only the
pick changes.

Liveness (DESIGN §4 rule 6): a request that fits the pools alone always finishes. The
oldest request is never a victim while a younger one exists, so it always progresses:
victims are the youngest first, the request growing preempts itself only when it is the
youngest, and ``running`` and ``waiting`` both stay in arrival (handle) order, so a
re-admitted request is not demoted to the youngest. A victim that a launched batch still
holds cannot be preempted yet: the growing request then stalls for one step, and so does
every running request younger than it (its potential victims), so that at the next step
none of them is in flight and the preemption goes through.

Overlap (one-step lag): ``on_launch`` commits a launched batch's computed tokens at once
and counts each token it samples as pending, so the next batch can be scheduled before
this one's result is processed: a decode's next input is the token being sampled (a
placeholder filled on the forward thread). A request in flight is never preempted; a
request about to reach ``max_tokens`` is not scheduled past it.

Speculation under overlap: a verify commits 1 .. k + 1 tokens, unknown until processed. A
request whose verify is in flight is scheduled for the next verify anyway (``chained``,
``ScheduledSeq.max_shift``): its row 0 and drafts are placeholders, and its start -- the
in-flight verify's start + 1 + the drafts it accepts -- is resolved on the forward thread,
which runs it after that verify (``workers.step_inputs.resolve_chained``). Pages cover the
furthest start. Not chained (the request waits a step): a request whose sampling reads
positions on the host (``bad_words``, ``min_tokens`` still blocking), whose in-flight
verify may end it (its next token reaches ``max_tokens``), or whose furthest verify would
pass the context length.

Tiers: a request admitted with a promotion (its prefix being copied in from the host tier)
joins ``running`` but gets no tokens, and is not preempted, until the copy completes.

Invariant: after ``schedule``, every running request holds a live slot and at least
``ceil((num_computed_tokens + num_new_tokens) / page_size)`` pages.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque

from configs.schema import SchedulerConfig
from workers.cache.manager import CacheManager
from workers.request import Request, RequestStatus
from workers.scheduler_types import ScheduledBatch, ScheduledSeq

__all__ = ["Scheduler", "ScheduledBatch", "ScheduledSeq", "pages_needed"]


LPM_WINDOW = 128  # lpm looks this deep into the queue (SGLang falls back to fcfs past 128)


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, cache: CacheManager, max_model_len: int, num_draft_tokens: int = 0
    ) -> None:
        self.config = config
        self.num_draft_tokens = num_draft_tokens  # > 0: decodes are speculative verifies
        self.cache = cache
        self.page_size = cache.page_size
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

    def release(self, request: Request, finished: bool = False) -> None:
        """Free a request's resources (publishing its checkpoint on a normal finish)."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self.cache.release(request, finished)
        elif request.status is RequestStatus.WAITING and request in self.waiting:
            self.waiting.remove(request)

    def on_launch(self, batch: ScheduledBatch) -> None:
        """Commit what a launched batch computes, before its result is processed.

        A verify commits 1 .. k + 1 tokens, unknown until processed: its request counts it
        in flight (``num_inflight_verifies``) and commits at ``on_complete``.
        """
        for seq in batch.seqs:
            req = seq.request
            req.inflight_batch = batch.batch_id
            if seq.is_verify:
                req.num_inflight_verifies += 1
                req.inflight_verify_drafts = seq.num_draft_tokens
                continue
            req.num_computed_tokens = seq.end
            if seq.samples:
                req.num_pending_tokens += 1
                req.has_drafts = self.num_draft_tokens > 0

    def on_complete(self, batch: ScheduledBatch, rows_committed: dict[int, int]) -> None:
        for i, seq in enumerate(batch.seqs):
            req = seq.request
            if req.inflight_batch == batch.batch_id:
                req.inflight_batch = None
            if seq.is_verify:
                # Verifies complete in launch order: the one before a chained verify has
                # moved num_computed_tokens to its actual start.
                req.num_inflight_verifies -= 1
                req.num_computed_tokens += rows_committed[i]
            elif seq.samples:
                req.num_pending_tokens -= 1

    def _preempt(self, request: Request) -> None:
        assert request.inflight_batch is None, request.request_id
        self.running.remove(request)
        self.cache.release(request, finished=False)
        request.num_computed_tokens = 0
        request.has_drafts = False
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._requeue(request)

    def _requeue(self, request: Request) -> None:
        """Back into the queue at its arrival position (ahead of every younger request)."""
        at = next((i for i, r in enumerate(self.waiting) if r.handle > request.handle), len(self.waiting))
        self.waiting.insert(at, request)

    # -- one step ----------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        budget = self.config.max_batch_tokens
        seqs: list[ScheduledSeq] = []
        preempted: list[Request] = []
        stalled = False  # a request could not grow: everyone younger waits a step
        for request in list(self.running):
            if stalled or request.status is not RequestStatus.RUNNING:  # preempted in this loop
                continue
            expected = request.num_expected_tokens
            n = self._num_to_compute(request, budget, expected)
            if n == 0:
                continue
            if not self._grow_pages(request, n, preempted, seqs, expected):
                stalled = request.status is RequestStatus.RUNNING
                continue
            seqs.append(self._scheduled(request, n, expected))
            budget -= n
        if not stalled and not preempted:
            self._admit(budget, seqs)
        if not seqs:
            return None
        batch = ScheduledBatch(self._next_batch_id, tuple(seqs), tuple(preempted))
        self._next_batch_id += 1
        return batch

    def _num_to_compute(self, request: Request, budget: int, expected: int) -> int:
        """``expected``: the request's ``num_expected_tokens``."""
        if request.num_inflight_verifies:
            return self._chained_len(request, budget)
        if request.num_pending_tokens and self._reaches_limit(request, expected):
            return 0
        if request.cache.promotion is not None:  # its prefix is still being copied in
            return 0
        missing = expected - request.num_computed_tokens
        if missing == 1 and self._verifies(request):
            return min(1 + self._num_drafts(request), budget)
        n = min(missing, self.config.chunked_prefill_size, budget)
        start = request.num_computed_tokens
        targets = self.cache.tracker.targets_within(request, start + n)
        if len(targets) > 1:
            n = targets[0] - start  # one checkpoint per chunk
        if targets and not self.cache.tracker.may_write_target(request):
            return 0
        return max(0, n)

    def _reaches_limit(self, request: Request, expected: int) -> bool:
        """The in-flight tokens already take the request to max_tokens / max_model_len."""
        outputs = request.num_output_tokens + request.num_pending_tokens
        return outputs >= request.params.max_tokens or expected >= self.max_model_len

    def _chained_len(self, request: Request, budget: int) -> int:
        """Rows of a verify chained after the request's in-flight one (0: it waits a step)."""
        p, n = request.params, 1 + self.num_draft_tokens
        furthest = request.num_computed_tokens + request.inflight_verify_drafts + 1 + self.num_draft_tokens
        if (
            request.num_inflight_verifies > 1
            or n > budget
            or p.bad_words
            or request.num_output_tokens < p.min_tokens
            or request.num_output_tokens + 1 >= p.max_tokens
            or furthest > self.max_model_len - 1
        ):
            return 0
        return n

    def _verifies(self, request: Request) -> bool:
        """Decode as a verify: speculation is on and the MTP head has drafted for the
        request since it was (re)started (every sampling step drafts)."""
        return self.num_draft_tokens > 0 and request.has_drafts

    def _num_drafts(self, request: Request) -> int:
        """Drafts for a verify at this request's next position, within the context."""
        return max(0, min(self.num_draft_tokens, self.max_model_len - 1 - request.num_computed_tokens))

    def _scheduled(self, request: Request, n: int, expected: int) -> ScheduledSeq:
        start = request.num_computed_tokens
        if request.num_inflight_verifies:
            return ScheduledSeq(
                request, start + 1, n, samples=True, num_draft_tokens=n - 1, max_shift=request.inflight_verify_drafts
            )
        if expected - start == 1 and self._verifies(request):
            return ScheduledSeq(request, start, n, samples=True, num_draft_tokens=n - 1)
        return ScheduledSeq(request, start, n, samples=start + n == expected)

    def _pages_short(self, request: Request, n: int, expected: int) -> int:
        end = request.num_computed_tokens + n
        if request.num_inflight_verifies:  # chained: it may start that much further
            end += request.inflight_verify_drafts + 1
        if self.num_draft_tokens and end >= expected:
            # The MTP head drafts (and writes its KV) up to k - 1 positions further.
            end = min(end + self.num_draft_tokens, self.max_model_len)
        return max(0, pages_needed(end, self.page_size) - len(request.page_ids))

    def _grow_pages(
        self, request: Request, n: int, preempted: list[Request], scheduled: list[ScheduledSeq], expected: int
    ) -> bool:
        """Give ``request`` pages for ``n`` more tokens, preempting the youngest if needed.

        A victim is the youngest running request not given work in this step (so never one
        older than ``request``; ``request`` itself only when it is the youngest). Returns
        False when ``request`` could not grow: it was the victim itself, or the victim is
        in flight (it cannot be preempted before its batch is processed).
        """
        need = self._pages_short(request, n, expected)
        if need == 0:
            return True
        busy: set[int] | None = None  # built only when a victim is needed
        while True:
            new = self.cache.alloc_pages(need)
            if new is not None:
                request.page_ids.extend(new)
                return True
            if busy is None:
                busy = {s.request.handle for s in scheduled}
            victim = next(r for r in reversed(self.running) if r.handle not in busy)
            if victim.inflight_batch is not None or victim.cache.promotion is not None:
                return False
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False

    def _next_waiting(self, depths: dict[int, int]) -> int:
        """The index in ``waiting`` of the request to admit next (see the module doc).
        ``depths`` memoizes cached depths by handle for one ``_admit`` call (one step)."""
        if self.config.policy == "fcfs":
            return 0
        window = range(min(len(self.waiting), LPM_WINDOW))
        due = next((i for i in window if self.waiting[i].num_bypassed >= self.config.lpm_max_bypass), None)
        if due is not None:
            return due
        for i in window:
            r = self.waiting[i]
            if r.handle not in depths:
                depths[r.handle] = self.cache.cached_depth(r)
        return max(window, key=lambda i: (depths[self.waiting[i].handle], -i))

    def _admit(self, budget: int, seqs: list[ScheduledSeq]) -> None:
        depths: dict[int, int] = {}
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running_requests:
            at = self._next_waiting(depths)
            request = self.waiting[at]
            if not self.cache.admit(request):
                break
            n, new, expected = 0, [], request.num_expected_tokens
            if request.cache.promotion is None:  # a promoting request runs once copied in
                n = self._num_to_compute(request, budget, expected)
                new = self.cache.alloc_pages(self._pages_short(request, n, expected)) if n > 0 else None
                if new is None:
                    self.cache.release(request, finished=False)
                    request.num_computed_tokens = 0
                    break
            del self.waiting[at]
            for older in itertools.islice(self.waiting, at):
                older.num_bypassed += 1
            request.page_ids.extend(new)
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=lambda r: r.handle)
            if n:
                seqs.append(self._scheduled(request, n, expected))
                budget -= n
