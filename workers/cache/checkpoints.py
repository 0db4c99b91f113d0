"""Mamba checkpoints during a request: where each is written, when it is published.

Strategies (``cache.mamba_strategy``, DESIGN §4):
- ``no_buffer``: only the live slot; at a normal finish the live state is published when
  its depth is page aligned.
- ``extra_buffer``: two owned track slots, ``keep`` (last committed checkpoint) and
  ``next`` (where the next one is written); they swap when a write completes.
- ``extra_buffer_lazy``: one owned track slot (``keep``); a second (``pending``) is
  borrowed per write without eviction; when that fails, the write goes in place into keep.

Checkpoint depths: prefill targets (the last page-aligned position a later match can
reach, ``((L - 1) // page) * page``, for a prompt resuming from no checkpoint the deepest
track-grid point at or below it -- so a later prompt that shares only a prefix of this
one, such as a system prompt, finds a checkpoint without a second request first writing
the branching point; a resumed prompt skips it, ``prefill_grid_target`` -- and the
branching point of a partial match; the
kernels snapshot the state at that position inside the chunk, and the scheduler cuts a
chunk that would hold two), multiples of the track grid
``lcm(mamba_track_interval, page_size)`` reached at the end of a step (decode, verify), and
the end of the output (``output_target``: the last page-aligned position a request that
runs to ``max_tokens`` computes; published at its finish, so that the next turn of a
conversation, which appends to the answer, resumes past the answer instead of from the
prompt).

Safety (DESIGN §4.1, the ledger rules): every slot a launched batch writes is registered as a
pending writer; ``donate`` never moves a slot with a pending writer: it skips, counts
``donations_skipped{path}`` and keeps the label, so the checkpoint is published later at
its true depth. Decisions about a batch read its frozen ``StepPlan`` only.

Labels are true by construction (I4): a keep depth is never taken from the plan but from
the ledger's content record of the slot, which holds what the runner reported it wrote
(``StateWrite``) when the batch's result was processed; a slot that another in-flight
batch will still write gets no label until that batch is processed too.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from configs.schema import CacheConfig, DebugConfig
from workers.cache import Checkpoint, RadixCache, RequestOwner, SlotLedger, SlotRole
from workers.request import Request
from workers.scheduler_types import ScheduledBatch, StateWrite
from workers.stats import EngineStats


class TrackerHost(Protocol):
    """What the tracker uses of the cache manager that owns it."""

    ledger: SlotLedger
    tree: RadixCache | None
    stats: EngineStats

    def alloc_slot(self, owner: RequestOwner, evict: bool) -> int | None: ...

    def free_pages(self, page_ids: Sequence[int], reader: int | None) -> None: ...

    def reader_of(self, req: Request) -> int | None: ...

    def report(self, invariant: str, message: str) -> None: ...

    def on_publish(self, slot: int, token_ids: list[int], phase: str) -> None: ...


@dataclass(frozen=True)
class TrackWrite:
    """Batch ``batch_id`` is planned to write H(``depth``) of ``request`` into ``slot`` (a
    verify only if it commits that far; the runner reports what it did write)."""

    seq_index: int
    request: Request
    slot: int
    depth: int
    phase: str  # "prefill" | "decode"
    inplace: bool  # lazy fallback: written into the keep slot itself
    batch_id: int


@dataclass(frozen=True)
class StepPlan:
    """Everything a launched batch will write besides KV, frozen at launch."""

    batch: ScheduledBatch
    cow: tuple[tuple[int, int], ...]  # (tree checkpoint slot, live slot) copies
    tracks: tuple[TrackWrite, ...]
    by_seq: dict[int, TrackWrite] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_seq", {w.seq_index: w for w in self.tracks})

    def written_slots(self) -> set[int]:
        slots = {s.request.mamba_slot for s in self.batch.seqs if s.request.mamba_slot}
        return slots | {w.slot for w in self.tracks} | {dst for _, dst in self.cow}

    def track_of(self, seq_index: int) -> TrackWrite | None:
        return self.by_seq.get(seq_index)

    def track_slot(self, seq_index: int) -> int:
        w = self.track_of(seq_index)
        return w.slot if w is not None else 0


class CheckpointTracker:
    def __init__(self, manager: TrackerHost, cache: CacheConfig, debug: DebugConfig, rng: random.Random) -> None:
        self.m = manager
        self.page_size = cache.page_size
        self.strategy = cache.mamba_strategy if manager.tree is not None else None
        self.grid = math.lcm(cache.mamba_track_interval, cache.page_size)
        self.fail_prob = debug.fail_pending_alloc_prob
        self.rng = rng

    @property
    def tracks(self) -> bool:
        return self.strategy in ("extra_buffer", "extra_buffer_lazy")

    # -- admission -------------------------------------------------------------------------
    def on_admit(self, req: Request, kv_depth: int, resume_depth: int = 0) -> None:
        """Plan the request's checkpoint targets. ``resume_depth``: the checkpoint its prefill
        starts from (a device hit, or a promotion being copied in); the grid target is only
        for a prompt resuming from none (see ``prefill_grid_target``)."""
        if not self.tracks:
            return
        ps, c = self.page_size, req.cache
        last_reachable = ((req.num_tokens - 1) // ps) * ps
        grid_below = self.prefill_grid_target(last_reachable, resume_depth)
        c.targets = sorted(
            {
                t
                for t in (kv_depth, grid_below, last_reachable, self.output_target(req))
                if t > req.num_computed_tokens and t >= ps
            }
        )
        c.keep_slot = self._alloc(req, SlotRole.KEEP, evict=True)
        if self.strategy == "extra_buffer":
            c.next_slot = self._alloc(req, SlotRole.PENDING, evict=True)

    def prefill_grid_target(self, last_reachable: int, resume_depth: int) -> int:
        """The deepest grid point at or below ``last_reachable`` for a prompt resuming from no
        checkpoint (0 = none otherwise). It exists for a prefix seen the first time that
        later prompts share only in part (a system prompt); it costs a step, since a chunk
        holding two targets is cut at the first. A prompt that resumes from a checkpoint
        continues its own context (the next turn of a conversation, which extends the
        prompt's end or the answer's); its branch points are written when a prompt first
        diverges there (``kv_depth``), so a grid cut would only add a step to its TTFT."""
        if resume_depth > 0:
            return 0
        return (last_reachable // self.grid) * self.grid

    def output_target(self, req: Request) -> int:
        """The deepest page-aligned state a request that runs to ``max_tokens`` computes:
        its last sampled token is never fed, so H(prompt + max_tokens - 1) is the last. None
        (0) for one token: that is the prompt's end, which the prefill leaves in the live
        slot and the finish publishes from there (``donate``) -- a snapshot of it would cut
        the prompt's last chunk in two (one target a chunk) for nothing. Only then: a live
        slot published at every aligned finish would crowd the pool's useful checkpoints."""
        last = req.num_prompt_tokens + req.params.max_tokens - 1
        if last == req.num_prompt_tokens:
            return 0
        return (last // self.page_size) * self.page_size

    def _alloc(self, req: Request, role: SlotRole, evict: bool) -> int | None:
        return self.m.alloc_slot(RequestOwner(req.handle, role), evict=evict)

    def targets_within(self, req: Request, end: int) -> list[int]:
        """Prefill checkpoint targets a chunk from ``num_computed_tokens`` to ``end`` covers."""
        return [t for t in req.cache.targets if req.num_computed_tokens < t <= end]

    def may_write_target(self, req: Request) -> bool:
        """Whether a prefill chunk may end at its checkpoint target now.

        Under the overlap lag the previous checkpoint's write may still be in flight. A
        second write into the same slot would make that checkpoint unpublishable (its
        donation is refused while the slot has a writer), and prefill checkpoints are the
        reusable ones, so the chunk waits one step unless a free destination exists.
        """
        if not self.tracks:
            return True
        c = req.cache
        if self.strategy == "extra_buffer_lazy" and c.pending_slot is None:
            c.pending_slot = self._alloc(req, SlotRole.PENDING, evict=False)
        second = c.next_slot if self.strategy == "extra_buffer" else c.pending_slot
        if second is None and c.keep_slot is None:
            return True  # nowhere to write: the checkpoint is skipped anyway
        return self._idle(second) or self._idle_keep(req)

    def _idle(self, slot: int | None) -> bool:
        return slot is not None and not self.m.ledger.has_writers(slot)

    def _idle_keep(self, req: Request) -> bool:
        """The keep slot may take a new write: no writer and nothing unpublished in it."""
        return self._idle(req.cache.keep_slot) and req.cache.keep_depth is None

    # -- launch ------------------------------------------------------------------------------
    def plan(self, batch: ScheduledBatch) -> StepPlan:
        cow, tracks = [], []
        for i, seq in enumerate(batch.seqs):
            req, c = seq.request, seq.request.cache
            if c.cow_src is not None:
                cow.append((c.cow_src, req.mamba_slot))
                c.cow_src = None
            depth = self._checkpoint_depth(seq)
            if depth is not None:
                phase = "prefill" if seq.start < req.num_prompt_tokens else "decode"
                dest = self._destination(req, phase, reuse_busy=not seq.is_chained)
                if dest is not None:
                    tracks.append(TrackWrite(i, req, dest[0], depth, phase, dest[1], batch.batch_id))
        return StepPlan(batch, tuple(cow), tuple(tracks))

    def _checkpoint_depth(self, seq) -> int | None:
        """The checkpoint this step may produce: a prefill target or a grid crossing.

        A verify commits 1 .. k + 1 tokens, so it may cross the grid anywhere in
        (start, end] -- a chained one in (start, end + max_shift] -- whether it did is
        known only from its acceptance (and, chained, the acceptance before it).
        """
        if not self.tracks:
            return None
        if seq.is_verify:
            crossing = (seq.start // self.grid + 1) * self.grid
            crossing = min([crossing] + [t for t in seq.request.cache.targets if seq.start < t])
            return crossing if crossing <= seq.end + seq.max_shift else None
        within = [t for t in seq.request.cache.targets if seq.start < t <= seq.end]
        if within:
            return within[-1]
        return seq.end if seq.end % self.grid == 0 else None

    def _destination(self, req: Request, phase: str, reuse_busy: bool = True) -> tuple[int, bool] | None:
        """Where this batch writes the request's checkpoint: (slot, in place into keep).

        The second slot (``next`` / ``pending``) when no in-flight batch writes it; else
        the keep slot when it is idle and holds nothing unpublished (the two alternate
        under the overlap lag); else the same slot again (stream order makes the newer
        write win; the older checkpoint's donation is then refused and counted); lazy
        with no second slot writes in place into keep. Not the same slot again for a
        chained verify (``reuse_busy`` False): it may not reach its depth, and the older
        checkpoint would be lost for nothing; it plans none, the next verify plans again.
        """
        c = req.cache
        if self.strategy == "extra_buffer":
            second = c.next_slot
        else:
            if c.pending_slot is None:
                failed = self.fail_prob > 0 and self.rng.random() < self.fail_prob
                c.pending_slot = None if failed else self._alloc(req, SlotRole.PENDING, evict=False)
                if c.pending_slot is None:
                    self.m.stats.inc("hybridserve_mamba_pending_alloc_failures_total")
            second = c.pending_slot
            if c.keep_slot is None and not self._idle(second):  # given up at the last publication
                # Only a prompt checkpoint may evict another for its slot: a decode one
                # saves the next turn at most the answer, less than what it would evict.
                c.keep_slot = self._alloc(req, SlotRole.KEEP, evict=phase == "prefill")
        if self._idle(second):
            return second, False  # type: ignore[return-value]
        if self._idle_keep(req) or (
            second is None and c.keep_slot is not None and (reuse_busy or self._idle(c.keep_slot))
        ):
            self.m.stats.inc("hybridserve_mamba_inplace_track_writes_total")
            return c.keep_slot, True  # type: ignore[return-value]
        return (second, False) if second is not None and reuse_busy else None

    # -- results ------------------------------------------------------------------------------
    def on_complete(self, plan: StepPlan, writes: Sequence[StateWrite]) -> None:
        """The batch's writes happened (``writes``, as the runner reports them, already in
        the ledger's content records): label the keep slots from them.

        A planned write the runner did not report (a verify that stopped short of the
        boundary) labels nothing.
        """
        written = {(w.seq_index, w.slot): w.depth for w in writes}
        for w in plan.tracks:
            depth = written.get((w.seq_index, w.slot))
            if depth is None:
                continue
            if depth != w.depth:  # a runner bug: the slot is never published
                self.m.report(
                    "I4", f"batch {w.batch_id} planned H({w.depth}) into slot {w.slot}; the runner wrote H({depth})"
                )
                if w.slot == w.request.cache.keep_slot:
                    w.request.cache.keep_depth = None
                continue
            self._label(w, depth)

    def _label(self, w: TrackWrite, depth: int) -> None:
        req, c, ledger = w.request, w.request.cache, self.m.ledger
        if req.mamba_slot is None:  # released meanwhile; its slots are gone
            return
        if req.is_finished:  # this batch's tokens for it are discarded
            if w.slot == c.keep_slot:  # ...and it overwrote the keep slot's state
                c.keep_depth = None
            return
        owner = ledger.owner_of(w.slot)
        if not (isinstance(owner, RequestOwner) and owner.handle == req.handle):
            # Only with debug.disable_alias_guard: the slot was given away while this batch
            # wrote it (the aliasing bug). Repair the label as SGLang did, onto whatever keep
            # slot the request holds now: an I4 lie that check_invariants reports.
            c.keep_depth, c.keep_phase, c.keep_batch = w.depth, w.phase, w.batch_id
            return
        if not ledger.may_move(w.slot):
            # A later in-flight batch writes this slot too (the same-slot fallback, or a
            # verify writing in place into keep): its content is not final, so this
            # checkpoint cannot be published; that batch's result labels the slot instead.
            self.m.stats.inc(
                "hybridserve_mamba_donations_skipped_total",
                label="prefill_unfinished" if w.phase == "prefill" else "decode",
            )
            if w.slot == c.keep_slot:
                c.keep_depth = None
            return
        if w.slot != c.keep_slot:
            self._promote(req, w.slot)
        content = ledger.content_of(w.slot)
        assert content is not None and content.depth == depth, (w, content)
        c.keep_depth, c.keep_phase, c.keep_batch = content.depth, w.phase, content.batch_id
        c.targets = [t for t in c.targets if t > content.depth]

    def _promote(self, req: Request, written: int) -> None:
        c, ledger = req.cache, self.m.ledger
        old_keep = c.keep_slot
        c.keep_slot = written
        ledger.relabel(written, SlotRole.KEEP)
        if self.strategy == "extra_buffer":
            c.next_slot = old_keep
            if old_keep is not None:
                ledger.relabel(old_keep, SlotRole.PENDING)
            else:
                c.next_slot = self._alloc(req, SlotRole.PENDING, evict=True)
            return
        c.pending_slot = None
        if old_keep is not None:
            if ledger.may_move(old_keep):
                ledger.free(old_keep)
            else:  # an in-flight batch still writes it: reuse later
                c.pending_slot = old_keep
                ledger.relabel(old_keep, SlotRole.PENDING)

    # -- publication ----------------------------------------------------------------------------
    def donate(self, req: Request, finished: bool) -> None:
        """Publish the keep slot's checkpoint into the tree (no copy), if allowed now. At the
        finish of a one-token request, then its live slot's state, the output target it
        planned no snapshot of (``output_target``), when page aligned and deeper."""
        if self.m.tree is None:
            return
        if finished and self.strategy == "no_buffer":
            self._live_as_keep(req)
        self._donate_keep(req, finished)
        if finished and self.tracks and req.params.max_tokens == 1 and req.cache.keep_depth is None:
            self._live_as_keep(req)
            self._donate_keep(req, finished)

    def _donate_keep(self, req: Request, finished: bool) -> None:
        c = req.cache
        if c.keep_slot is None or c.keep_depth is None:
            return
        path = (
            f"{c.keep_phase}_finished"
            if finished
            else ("prefill_unfinished" if c.keep_phase == "prefill" else "decode")
        )
        if not self.m.ledger.may_move(c.keep_slot):
            self.m.stats.inc("hybridserve_mamba_donations_skipped_total", label=path)
            return
        if c.keep_depth <= c.num_tree_pages * self.page_size or c.keep_depth > req.num_tokens:
            # Nothing new, or a verify checkpoint past where the output was cut (a stop).
            c.keep_depth = None
            return
        self._insert(req, finished)

    def _live_as_keep(self, req: Request) -> None:
        """At finish, the live slot as the checkpoint, at the depth of what it holds (a
        discarded batch may have advanced it past the request's tokens: then none)."""
        live = req.mamba_slot
        if live is None or self.m.ledger.has_writers(live):
            return
        content = self.m.ledger.content_of(live)
        if content is None or content.depth % self.page_size or content.depth > req.num_tokens:
            return
        req.cache.keep_slot, req.cache.keep_depth = live, content.depth
        req.cache.keep_batch = content.batch_id
        req.cache.keep_phase = "decode" if content.depth > req.num_prompt_tokens else "prefill"

    def _insert(self, req: Request, finished: bool) -> None:
        c, tree, stats = req.cache, self.m.tree, self.m.stats
        assert tree is not None and c.keep_slot is not None and c.keep_depth is not None
        depth, slot = c.keep_depth, c.keep_slot
        tokens = req.all_token_ids[:depth]
        num_pages = depth // self.page_size
        result = tree.insert(
            tokens, req.page_ids[:num_pages], Checkpoint.for_tokens(slot, tokens, self.page_size, c.keep_batch)
        )
        self.m.free_pages(result.duplicate_page_ids, self.m.reader_of(req))
        req.page_ids[:num_pages] = result.page_ids
        req.page_epoch += 1  # the prefix's ids may be the tree's copies now
        c.num_tree_pages = num_pages
        tree.lock(result.node)
        if c.locked_node is not None:
            tree.unlock(c.locked_node)  # type: ignore[arg-type]
        c.locked_node = result.node
        c.keep_depth = None
        if result.duplicate_checkpoint:
            stats.inc("hybridserve_mamba_duplicate_inserts_total")
            return
        stats.inc("hybridserve_mamba_donations_total")
        phase = "finish" if finished else c.keep_phase
        stats.inc("hybridserve_mamba_checkpoints_inserted_total", label=phase)
        self.m.on_publish(slot, tokens, phase)
        if slot == req.mamba_slot:  # the live slot itself was given away
            req.mamba_slot = None
        c.keep_slot = None
        if not finished and self.strategy == "extra_buffer":  # its two track slots are owned
            c.keep_slot = self._alloc(req, SlotRole.KEEP, evict=True)
        # Lazy takes no new keep slot now: one held with nothing to write into starves the
        # admissions of others (3 running with live + keep + their published checkpoint
        # fill 8 slots and the third never checkpoints its prompt). Its next write goes to
        # a borrowed pending slot or, without one, into a keep slot taken then
        # (``_destination``).
