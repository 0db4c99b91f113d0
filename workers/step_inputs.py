"""Host-side preparation of one step: flat token rows, KV locations, snapshot targets.

Built on the scheduler thread at launch. Values that only the forward thread will know
(the token the batch before is sampling, MTP drafts) are placeholder rows, filled there
from per-slot registers.

Row layout of a verify of k drafts at position p: row 0 is token p (known, or sampled
by the in-flight batch), rows 1..k are the drafts; every row's state is snapshotted into
its own scratch slot so the state after the last accepted token can be committed.

A chained verify (``ScheduledSeq.is_chained``) is prepared at its least start; on the
forward thread, after the verify before it has been decided, ``resolve_chained`` moves its
rows by the drafts that one accepted (positions, context lengths and KV locations on the
device, from the runner's per-slot register; the host copies of its start from the host
one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from workers.cache.checkpoints import StepPlan
from workers.forward_batch import ForwardBatch, is_decode_only, uniform_snapshot_len
from workers.sampling.inputs import SamplingInputs
from workers.scheduler_types import StateWrite


@dataclass(frozen=True)
class VerifyRows:
    seq_index: int
    first_row: int
    num_drafts: int
    live_slot: int
    scratch: tuple[int, ...]  # one snapshot slot per row (k + 1)
    track_slot: int  # 0: no checkpoint planned in this verify
    track_depth: int

    def commit(self, num_accepted: int, start: int) -> tuple[list[int], list[int], tuple[StateWrite, ...]]:
        """(scratch sources, destinations, what lands where) when ``num_accepted`` drafts were
        accepted and row 0 was at position ``start`` (``PreparedStep.starts``: a chained
        verify's is known on the forward thread only): the live slot takes the state after
        row ``num_accepted`` (depth start + accepted + 1); the track slot, if planned and
        reached, the state after the row that ends at ``track_depth`` (a chained verify may
        start past it: nothing then)."""
        src, dst = [self.scratch[num_accepted]], [self.live_slot]
        writes = [StateWrite(self.seq_index, self.live_slot, start + num_accepted + 1)]
        crossed_row = self.track_depth - 1 - start
        if self.track_slot and 0 <= crossed_row <= num_accepted:
            src.append(self.scratch[crossed_row])
            dst.append(self.track_slot)
            writes.append(StateWrite(self.seq_index, self.track_slot, start + crossed_row + 1))
        return src, dst, tuple(writes)


@dataclass(frozen=True)
class PreparedStep:
    plan: StepPlan
    fb: ForwardBatch
    future_rows: torch.Tensor | None  # rows whose token the batch before is sampling
    future_slots: torch.Tensor | None  # ... read from last_token[slot]
    draft_rows: torch.Tensor | None  # rows holding MTP drafts
    draft_slots: torch.Tensor | None  # ... read from draft_tokens[slot, index]
    draft_index: torch.Tensor | None
    verify: tuple[VerifyRows, ...]
    next_tokens: tuple[int | None, ...]  # per seq: the known token after a non-final chunk
    # Per seq, frozen at launch: the host may edit the request's lists while this runs.
    page_ids: Sequence[Sequence[int]] = ()
    live_slots: tuple[int, ...] = ()
    # What the non-verify sequences write into ledger slots, read off the rows above (the
    # live slot after the last row, each snapshot row's slot); verifies add theirs at commit.
    writes: tuple[StateWrite, ...] = ()
    sampling: SamplingInputs | None = None  # host tensors (workers.sampling.build), set at launch
    # Host copies of ``fb.input_ids`` (placeholder rows -1: filled on the device) and
    # ``fb.cu_seqlens``: the drafter's inputs are built from them, not read back.
    row_ids: Sequence[int] = ()
    cu_seqlens: Sequence[int] = ()
    # A decode batch's snapshots, copied live slot -> snapshot slot after the forward
    # (``prepare_step``: the batch itself runs as a plain decode step); None: no copies.
    copy_src: torch.Tensor | None = None
    copy_dst: torch.Tensor | None = None
    # Per seq, its first position (a chained verify's least until ``resolve_chained``).
    starts: tuple[int, ...] = ()
    # Chained verifies: seq indices, their live slots, and per row of theirs: the row, its
    # seq, its index among them (all None without one).
    chained_seqs: tuple[int, ...] = ()
    chained_seq_index: torch.Tensor | None = None
    chained_slots: torch.Tensor | None = None
    chained_rows: torch.Tensor | None = None
    chained_row_seq: torch.Tensor | None = None
    chained_row_pos: torch.Tensor | None = None
    # Every sequence samples once per row it has (``logits_indices`` is every row): the
    # logits need no gather. ``sample_slots``: the sampling sequences' live slots (int64).
    logits_all_rows: bool = False
    sample_slots: torch.Tensor | None = None
    # GPU: host-to-device copies still landing on a side stream (``uniform_inputs.Upload``).
    uploads: tuple = ()


class _Rows:
    """Accumulates the flat rows of one step."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.positions: list[int] = []
        self.out_loc: list[int] = []
        self.dst: list[int] = []
        self.future: list[tuple[int, int]] = []
        self.drafts: list[tuple[int, int, int]] = []
        self.logits: list[int] = []
        self.writes: list[StateWrite] = []
        self.num_scratch = 0  # scratch slots handed to the verifies so far


def _add_seq(
    rows: _Rows, b: int, seq, plan: StepPlan, page_size: int, scratch_base: int, verify: list[VerifyRows]
) -> None:
    req = seq.request
    first = len(rows.ids)
    for i, pos in enumerate(range(seq.start, seq.end)):
        if i >= 1 and seq.is_verify:
            rows.drafts.append((len(rows.ids), req.mamba_slot, i - 1))
            rows.ids.append(0)
        elif pos < req.num_tokens:
            rows.ids.append(req.token_at(pos))
        else:
            rows.future.append((len(rows.ids), req.mamba_slot))
            rows.ids.append(0)
        rows.positions.append(pos)
        rows.out_loc.append(req.page_ids[pos // page_size] * page_size + pos % page_size)
    if seq.is_verify:
        n = seq.num_new_tokens
        base = scratch_base + rows.num_scratch  # widths may differ
        rows.num_scratch += n
        scratch = tuple(range(base, base + n))
        rows.dst.extend(scratch)
        rows.logits.extend(range(first, first + n))
        track = plan.track_of(b)
        verify.append(
            VerifyRows(
                b,
                first,
                seq.num_draft_tokens,
                req.mamba_slot,
                scratch,
                track.slot if track else 0,
                track.depth if track else 0,
            )
        )
        return
    dst = [0] * seq.num_new_tokens
    track = plan.track_of(b)
    if track is not None:
        dst[track.depth - 1 - seq.start] = track.slot  # the state after token depth - 1
    rows.writes.extend(StateWrite(b, slot, rows.positions[first + i] + 1) for i, slot in enumerate(dst) if slot)
    rows.writes.append(StateWrite(b, req.mamba_slot, rows.positions[-1] + 1))
    rows.dst.extend(dst)
    if seq.samples:
        rows.logits.append(len(rows.ids) - 1)


class _Walk(NamedTuple):
    rows: _Rows
    verify: list[VerifyRows]
    cu: list[int]
    page_table: list[list[int]]
    next_tokens: list[int | None]


def _walk(plan: StepPlan, page_size: int, scratch_base: int) -> _Walk:
    """Every sequence's rows, verify rows, row bounds, page-table row and known next token."""
    walk = _Walk(_Rows(), [], [0], [], [])
    max_pages = max(len(s.request.page_ids) for s in plan.batch.seqs)
    for b, seq in enumerate(plan.batch.seqs):
        _add_seq(walk.rows, b, seq, plan, page_size, scratch_base, walk.verify)
        pages = seq.request.page_ids
        walk.page_table.append(list(pages) + [0] * (max_pages - len(pages)))
        walk.cu.append(len(walk.rows.ids))
        known = seq.end < seq.request.num_tokens
        walk.next_tokens.append(seq.request.token_at(seq.end) if known and not seq.samples else None)
    return walk


def prepare_step(plan: StepPlan, page_size: int, device: torch.device, scratch_base: int) -> PreparedStep:
    batch = plan.batch
    rows, verify, cu, page_table, next_tokens = _walk(plan, page_size, scratch_base)

    def t(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    def opt(values: list, dtype: torch.dtype = torch.int64) -> torch.Tensor | None:
        return t(values, dtype) if values else None

    snapshots = plan.tracks or verify
    has_init = [s.start > 0 for s in batch.seqs]
    num_new = [s.num_new_tokens for s in batch.seqs]
    # A decode batch (one token per sequence) whose snapshots are all of that token: the
    # state after it is the live slot's own, so the batch runs as a decode step (compiled
    # where a bucket fits) and the runner copies live -> snapshot slot after the forward.
    decode_copies: list[tuple[int, int]] = []
    if snapshots and not verify and is_decode_only(num_new, has_init, None):
        decode_copies = [(s.request.mamba_slot, d) for s, d in zip(batch.seqs, rows.dst) if d]
        snapshots = ()
    fb = ForwardBatch(
        input_ids=t(rows.ids, torch.int64),
        positions=t(rows.positions, torch.int64),
        cu_seqlens=t(cu, torch.int32),
        seq_lens=t([s.end for s in batch.seqs], torch.int32),
        out_loc=t(rows.out_loc, torch.int64),
        page_table=t(page_table, torch.int32),
        mamba_slot_ids=t([s.request.mamba_slot for s in batch.seqs], torch.int32),
        has_initial_state=t(has_init, torch.bool),
        logits_indices=t(rows.logits, torch.int64),
        page_size=page_size,
        state_dst_slots=t(rows.dst, torch.int32) if snapshots else None,
        decode_only=is_decode_only(num_new, has_init, None if decode_copies else rows.dst),
        verify_len=uniform_snapshot_len(num_new, has_init, rows.dst if snapshots else None),
    )
    return PreparedStep(
        plan,
        fb,
        opt([r for r, _ in rows.future]),
        opt([s for _, s in rows.future]),
        opt([r for r, _, _ in rows.drafts]),
        opt([s for _, s, _ in rows.drafts]),
        opt([i for _, _, i in rows.drafts]),
        tuple(verify),
        tuple(next_tokens),
        tuple(tuple(s.request.page_ids) for s in batch.seqs),
        tuple(s.request.mamba_slot for s in batch.seqs),
        tuple(rows.writes),
        row_ids=_host_ids(rows),
        cu_seqlens=tuple(cu),
        copy_src=opt([a for a, _ in decode_copies]),
        copy_dst=opt([d for _, d in decode_copies]),
        starts=tuple(s.start for s in batch.seqs),
        **_chained_fields(batch.seqs, cu, opt),
    )


def _chained_fields(seqs, cu: list[int], opt) -> dict:
    """The chained verifies (``PreparedStep.chained_*``): their sequences, slots, rows."""
    chained = [b for b, s in enumerate(seqs) if s.is_chained]
    rows = [(r, b, j) for j, b in enumerate(chained) for r in range(cu[b], cu[b + 1])]
    return dict(
        chained_seqs=tuple(chained),
        chained_seq_index=opt(chained),
        chained_slots=opt([seqs[b].request.mamba_slot for b in chained]),
        chained_rows=opt([r for r, _, _ in rows]),
        chained_row_seq=opt([b for _, b, _ in rows]),
        chained_row_pos=opt([j for _, _, j in rows]),
    )


def resolve_chained(prepared: PreparedStep, accepted: torch.Tensor, accepted_host: Sequence[int]) -> PreparedStep:
    """Move each chained verify by the drafts its request's previous verify accepted
    (``accepted`` / ``accepted_host``: per live slot, on the device / host); the device
    tensors are edited in place, the host copies of the starts replaced."""
    if not prepared.chained_seqs:
        return prepared
    fb, ps = prepared.fb, prepared.fb.page_size
    assert prepared.chained_slots is not None and prepared.chained_rows is not None
    assert prepared.chained_row_seq is not None and prepared.chained_row_pos is not None
    assert prepared.chained_seq_index is not None
    shift = accepted[prepared.chained_slots]
    rows = prepared.chained_rows
    fb.positions.index_add_(0, rows, shift[prepared.chained_row_pos])
    fb.seq_lens.index_add_(0, prepared.chained_seq_index, shift.to(fb.seq_lens.dtype))
    pos = fb.positions[rows]
    page = fb.page_table[prepared.chained_row_seq, pos // ps].to(fb.out_loc.dtype)
    fb.out_loc[rows] = page * ps + pos % ps
    starts = list(prepared.starts)
    for b in prepared.chained_seqs:
        starts[b] += accepted_host[prepared.live_slots[b]]
    return replace(prepared, starts=tuple(starts))


def _host_ids(rows: _Rows) -> tuple[int, ...]:
    ids = list(rows.ids)
    for r in [r for r, _ in rows.future] + [r for r, _, _ in rows.drafts]:
        ids[r] = -1
    return tuple(ids)
