"""The steady state's inputs, vectorized: a batch whose every sequence is a decode (one row)
or every sequence a verify (1 + k rows), each sampling, past its first token.

The general builder (``workers.step_inputs.prepare_step``) walks every row in Python and
rebuilds each sequence's page table; here a sequence costs one pass over a few of its
fields, the page table is a snapshot of the persistent rows (``workers.input_batch``), and
the rest is numpy over all rows at once. The integer inputs travel in two packed arrays
(int64, int32): one host-to-device copy each instead of one per tensor; on a GPU from
pinned memory on a side stream, with an event the forward waits on (``Upload``), so a
step's inputs do not queue behind the forward in flight. Same ``PreparedStep`` as the
general builder (tested equal: ``tests/workers/test_uniform_inputs.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from workers.cache.checkpoints import StepPlan
from workers.forward_batch import ForwardBatch
from workers.input_batch import InputBatch
from workers.sampling.inputs import SamplingInputs
from workers.scheduler_types import ScheduledBatch, StateWrite
from workers.step_inputs import PreparedStep, VerifyRows


class PageRows(Sequence):
    """Per sequence, its page ids (zero-padded to the step's widest): a step's page table
    read as lists, only where one is asked for (the MTP drafter)."""

    def __init__(self, table: np.ndarray) -> None:
        self._table = table

    def __len__(self) -> int:
        return len(self._table)

    def __getitem__(self, b):  # type: ignore[override]
        return self._table[b].tolist()


def uniform_rows(batch: ScheduledBatch) -> int:
    """Rows per sequence when ``batch`` is uniform (see the module doc), else 0."""
    seqs = batch.seqs
    rows = seqs[0].num_new_tokens
    verify = seqs[0].is_verify
    if rows != 1 and not verify:
        return 0
    for s in seqs:
        if s.num_new_tokens != rows or s.is_verify != verify or not s.samples or s.start == 0:
            return 0
    return rows


class _Pack:
    """Host arrays of one dtype, each read back as a tensor of its shape (inference tensors,
    as a compiled step's guards saw at warm-up: ``workers.compiled.steps.pad_if_needed`` then
    passes them on uncopied). On a GPU they travel concatenated, one copy for the pack; on a
    CPU each array is the tensor's memory (``torch.from_numpy``, no copy and no torch op,
    which would release the GIL to the forward thread)."""

    def __init__(self, dtype: type) -> None:
        self.dtype = dtype
        self.names: list[str] = []
        self.parts: list[np.ndarray] = []

    def add(self, name: str, values: np.ndarray | Sequence[int]) -> None:
        self.names.append(name)
        self.parts.append(np.asarray(values, dtype=self.dtype))

    def to(self, device: torch.device, uploads: list[Upload]) -> dict[str, torch.Tensor]:
        """The tensors, on ``device``; a GPU copy is appended to ``uploads``."""
        if not self.parts:
            return {}
        with torch.inference_mode():
            if device.type != "cuda":
                return {name: torch.from_numpy(part) for name, part in zip(self.names, self.parts)}
            flat = upload(torch.from_numpy(np.concatenate([p.reshape(-1) for p in self.parts])), device, uploads)
            views = flat.split([p.size for p in self.parts])
            return {name: v.view(p.shape) for name, v, p in zip(self.names, views, self.parts)}


class Upload(NamedTuple):
    """A host-to-device copy issued on the side stream: ``ready`` once it has landed."""

    tensor: torch.Tensor
    ready: torch.cuda.Event


_COPY_STREAMS: dict[int, torch.cuda.Stream] = {}


def upload(host: torch.Tensor, device: torch.device, uploads: list[Upload]) -> torch.Tensor:
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _COPY_STREAMS.get(index)
    if stream is None:
        stream = _COPY_STREAMS[index] = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        out = host.pin_memory().to(device, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(stream)
    uploads.append(Upload(out, ready))
    return out


def await_uploads(uploads: Sequence[Upload]) -> None:
    """Forward thread: the current stream waits for the step's copies, and their memory is
    marked in use by it (the caching allocator must not hand it out before it is done)."""
    if uploads:
        current = torch.cuda.current_stream()
        for u in uploads:
            current.wait_event(u.ready)
            u.tensor.record_stream(current)


class _Shape(NamedTuple):
    """A uniform step's inputs that depend on its shape alone, built once per shape: the
    graph and the sampler only read them."""

    seq_of_row: np.ndarray  # [B * rows]
    offsets: np.ndarray  # [rows]
    cu_seqlens: torch.Tensor
    has_initial: torch.Tensor
    logits_indices: torch.Tensor
    dst: torch.Tensor | None  # verify: scratch slot per row
    draft_rows: torch.Tensor | None
    draft_index: torch.Tensor | None


_SHAPES: dict[tuple[int, int, bool, int, torch.device], _Shape] = {}


def _shape(n_seq: int, rows: int, verify: bool, scratch_base: int, device: torch.device) -> _Shape:
    key = (n_seq, rows, verify, scratch_base, device)
    shape = _SHAPES.get(key)
    if shape is None:
        with torch.inference_mode():
            shape = _SHAPES[key] = _new_shape(n_seq, rows, verify, scratch_base, device)
    return shape


def _new_shape(n_seq: int, rows: int, verify: bool, scratch_base: int, device: torch.device) -> _Shape:
    def t(values: np.ndarray, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.as_tensor(values, dtype=dtype).to(device)

    offsets = np.arange(rows, dtype=np.int64)
    draft_rows = (np.arange(n_seq)[:, None] * rows + offsets[1:]).reshape(-1)
    return _Shape(
        np.repeat(np.arange(n_seq), rows),
        offsets,
        t(np.arange(0, n_seq * rows + 1, rows), torch.int32),
        torch.ones(n_seq, dtype=torch.bool, device=device),
        t(np.arange(n_seq * rows) if verify else np.arange(n_seq)),
        t(scratch_base + np.arange(n_seq * rows), torch.int32) if verify else None,
        t(draft_rows) if verify else None,
        t(np.tile(offsets[:-1], n_seq)) if verify else None,
    )


def prepare_uniform(
    plan: StepPlan,
    inputs: InputBatch,
    rows: int,
    page_size: int,
    device: torch.device,
    scratch_base: int,
    sampling: SamplingInputs | None = None,
) -> PreparedStep:
    """The ``PreparedStep`` of a uniform batch of ``rows`` rows per sequence."""
    seqs = plan.batch.seqs
    n_seq, verify = len(seqs), seqs[0].is_verify
    starts, slots, first_ids, tracks = _seq_fields(plan)
    shape = _shape(n_seq, rows, verify, scratch_base, device)
    table = inputs.table(inputs.rows([s.request for s in seqs]))
    i64, i32 = _Pack(np.int64), _Pack(np.int32)
    slot = _add_rows(i64, i32, shape, table, starts, slots, first_ids, rows, page_size)
    verify_rows, writes = _rows_and_writes(i64, plan, starts, slots, slot, tracks, rows, scratch_base)
    chained = [b for b, s in enumerate(seqs) if s.is_chained]
    if chained:
        _add_chained(i64, chained, slot, rows, shape.offsets)
    uploads: list[Upload] = []
    t64, t32 = i64.to(device, uploads), i32.to(device, uploads)
    fb = _forward_batch(t64, t32, shape, rows if verify else 0, page_size)
    return PreparedStep(
        plan,
        fb,
        t64.get("future_rows"),
        t64.get("future_slots"),
        shape.draft_rows,
        t64.get("draft_slots"),
        shape.draft_index,
        verify_rows,
        (None,) * n_seq,
        PageRows(table),
        tuple(slots),
        writes,
        sampling=sampling,
        row_ids=(),
        cu_seqlens=range(0, n_seq * rows + 1, rows),
        copy_src=t64.get("copy_src"),
        copy_dst=t64.get("copy_dst"),
        starts=tuple(starts),
        chained_seqs=tuple(chained),
        **{name: t64.get(name) for name in CHAINED},
        logits_all_rows=True,
        sample_slots=t64["sample_slots"],
        uploads=tuple(uploads),
    )


def _seq_fields(plan: StepPlan) -> tuple[list[int], list[int], list[int], list[tuple[int, int, int]]]:
    """Per sequence: its start, live slot, first input token (-1: being sampled by the step
    in flight) and, where the plan writes one, its checkpoint (seq index, slot, depth)."""
    starts, slots, first_ids, tracks = [], [], [], []
    for b, seq in enumerate(plan.batch.seqs):
        req = seq.request
        starts.append(seq.start)
        slots.append(req.mamba_slot)
        known = seq.start < len(req.prompt_token_ids) + len(req.output_token_ids)
        first_ids.append(req.token_at(seq.start) if known else -1)
        track = plan.by_seq.get(b)
        if track is not None:
            tracks.append((b, track.slot, track.depth))
    return starts, slots, first_ids, tracks


def _add_rows(
    i64: _Pack,
    i32: _Pack,
    shape: _Shape,
    table: np.ndarray,
    starts: list[int],
    slots: list[int],
    first_ids: list[int],
    rows: int,
    page_size: int,
) -> np.ndarray:
    """The rows' ids, positions and KV locations, the sequences' slots, lengths and page
    table; the slots as an array."""
    n_seq = len(starts)
    start = np.asarray(starts, dtype=np.int64)
    slot = np.asarray(slots, dtype=np.int64)
    positions = (start[:, None] + shape.offsets).reshape(-1)
    page_ids = table[shape.seq_of_row, positions // page_size].astype(np.int64)
    out_loc = page_ids * page_size + positions % page_size
    ids = np.zeros((n_seq, rows), dtype=np.int64)
    future = [b for b, t in enumerate(first_ids) if t < 0]
    if len(future) < n_seq:
        ids[:, 0] = np.maximum(first_ids, 0)
    i64.add("input_ids", ids.reshape(-1))
    i64.add("positions", positions)
    i64.add("out_loc", out_loc)
    i64.add("sample_slots", slot)
    if future:
        i64.add("future_rows", np.asarray(future, dtype=np.int64) * rows)
        i64.add("future_slots", slot[future])
    i32.add("seq_lens", start + rows)
    i32.add("slots", slot)
    i32.add("table", table)
    return slot


def _rows_and_writes(
    i64: _Pack,
    plan: StepPlan,
    starts: list[int],
    slots: list[int],
    slot: np.ndarray,
    tracks: list[tuple[int, int, int]],
    rows: int,
    scratch_base: int,
) -> tuple[tuple[VerifyRows, ...], tuple[StateWrite, ...]]:
    """A verify's rows (and its drafts' slots), or a decode's state writes (and its
    checkpoints' copies)."""
    if plan.batch.seqs[0].is_verify:
        i64.add("draft_slots", np.repeat(slot, rows - 1))
        return _verify_rows(plan.batch.seqs, starts, slots, tracks, rows, scratch_base), ()
    writes = [StateWrite(b, s, p + 1) for b, (s, p) in enumerate(zip(slots, starts))]
    writes += [StateWrite(b, s, d) for b, s, d in tracks]
    if tracks:
        i64.add("copy_src", [slots[b] for b, _, _ in tracks])
        i64.add("copy_dst", [s for _, s, _ in tracks])
    return (), tuple(writes)


CHAINED = ("chained_seq_index", "chained_slots", "chained_rows", "chained_row_seq", "chained_row_pos")


def _add_chained(i64: _Pack, chained: list[int], slot: np.ndarray, rows: int, offsets: np.ndarray) -> None:
    """The chained verifies' rows, slots and positions among them."""
    i64.add("chained_seq_index", chained)
    i64.add("chained_slots", slot[chained])
    i64.add("chained_rows", (np.asarray(chained)[:, None] * rows + offsets).reshape(-1))
    i64.add("chained_row_seq", np.repeat(chained, rows))
    i64.add("chained_row_pos", np.repeat(np.arange(len(chained)), rows))


def _forward_batch(
    t64: dict[str, torch.Tensor], t32: dict[str, torch.Tensor], shape: _Shape, verify_len: int, page_size: int
) -> ForwardBatch:
    return ForwardBatch(
        input_ids=t64["input_ids"],
        positions=t64["positions"],
        cu_seqlens=shape.cu_seqlens,
        seq_lens=t32["seq_lens"],
        out_loc=t64["out_loc"],
        page_table=t32["table"],
        mamba_slot_ids=t32["slots"],
        has_initial_state=shape.has_initial,
        logits_indices=shape.logits_indices,
        page_size=page_size,
        state_dst_slots=shape.dst,
        decode_only=not verify_len,
        verify_len=verify_len,
    )


def _verify_rows(
    seqs, starts: list[int], slots: list[int], tracks: list[tuple[int, int, int]], rows: int, scratch_base: int
) -> tuple[VerifyRows, ...]:
    track_of = {b: (s, d) for b, s, d in tracks}
    out = []
    for b, seq in enumerate(seqs):
        base = scratch_base + b * rows
        slot, depth = track_of.get(b, (0, 0))
        out.append(
            VerifyRows(b, b * rows, seq.num_draft_tokens, slots[b], tuple(range(base, base + rows)), slot, depth)
        )
    return tuple(out)
