"""Host-side planning shared by the Triton launchers of the recurrent ops (no triton import).

A varlen batch is split by sequence length: sequences of ``1..recurrent_max_len`` tokens
(decodes, speculative verifies, short chunks) go to one per-token recurrent kernel launch,
which writes a snapshot after any token; longer ones go to the chunked kernels.

The chunked kernels work on a chunk table rather than on fixed chunk multiples: a long
sequence is cut into chunks of at most ``block_t`` tokens, and additionally *after every
token with a snapshot slot* (the chunking restarts there, like the reference's segments).
So a snapshot always falls on a chunk end, where the sequential state pass holds exactly the
state to write. Without snapshots a sequence of L tokens has ceil(L / block_t) chunks.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from kernels import SeqPlan, make_plan
from kernels.memo import TensorMemo
from kernels.recurrent_batch import RecurrentBatch


class LengthSplit(NamedTuple):
    short: list[int]  # sequences with 1..recurrent_max_len tokens
    long: list[int]  # sequences with more


class ChunkTable(NamedTuple):
    """Chunks of the long sequences, in order; all int32 device tensors.

    Sequence ``seq_ids[i]`` owns chunks ``seq_chunk_offsets[i] : seq_chunk_offsets[i + 1]``;
    chunk c covers rows ``chunk_starts[c] : chunk_starts[c] + chunk_lens[c]`` and, when
    ``chunk_dst[c] != 0``, the state after its last token is also written to that slot.
    """

    seq_ids: Tensor  # [n]
    seq_chunk_offsets: Tensor  # [n + 1]
    chunk_starts: Tensor  # [num_chunks]
    chunk_lens: Tensor  # [num_chunks]
    chunk_dst: Tensor  # [num_chunks]
    num_chunks: int


def split_by_length(plan: SeqPlan, recurrent_max_len: int) -> LengthSplit:
    short = [b for b, n in enumerate(plan.lens) if 0 < n <= recurrent_max_len]
    long = [b for b, n in enumerate(plan.lens) if n > recurrent_max_len]
    return LengthSplit(short, long)


def build_chunk_table(plan: SeqPlan, seqs: list[int], block_t: int, device: torch.device) -> ChunkTable:
    starts: list[int] = []
    lens: list[int] = []
    dsts: list[int] = []
    offsets = [0]
    for b in seqs:
        seg_start, end = plan.starts[b], plan.starts[b] + plan.lens[b]
        cuts = [t + 1 for t in range(seg_start, end) if plan.dst is not None and plan.dst[t]]
        for seg_end in cuts + ([end] if not cuts or cuts[-1] != end else []):
            for c0 in range(seg_start, seg_end, block_t):
                c1 = min(c0 + block_t, seg_end)
                starts.append(c0)
                lens.append(c1 - c0)
                dsts.append(plan.dst[c1 - 1] if plan.dst is not None else 0)
            seg_start = seg_end
        offsets.append(len(starts))

    def as_tensor(values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    return ChunkTable(
        as_tensor(seqs), as_tensor(offsets), as_tensor(starts), as_tensor(lens), as_tensor(dsts), len(starts)
    )


def uniform_plan(num_seqs: int, device: torch.device) -> LaunchPlan:
    """The plan of ``num_seqs`` sequences of one short length each: all of them in the
    recurrent launch (``torch.arange`` on the device: no host read, capturable)."""
    ids = torch.arange(num_seqs, dtype=torch.int32, device=device) if num_seqs else None
    return LaunchPlan(ids, None)


def index_tensor(values: list[int], device: torch.device) -> Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def block_size(n: int, lo: int = 16, hi: int | None = None) -> int:
    """next_pow2(n) clamped to [lo, hi]: tl.dot needs every tile dim >= 16 on GPU."""
    size = max(lo, next_pow2(n))
    return size if hi is None else min(size, hi)


class LaunchPlan(NamedTuple):
    """Everything host-side a recurrent op's Triton launch needs for one batch."""

    short_ids: Tensor | None  # int32 [number of short sequences] on the device
    chunks: ChunkTable | None  # of the long ones


_plans: TensorMemo[LaunchPlan] = TensorMemo()


def launch_plan(
    cu_seqlens: Tensor,
    state_dst_slots: Tensor | None,
    recurrent_max_len: int,
    block_t: int,
    device: torch.device,
    uniform_len: int = 0,
) -> LaunchPlan:
    """The launch plan of a batch, memoised on its metadata tensors (``kernels.memo``).

    Building it reads ``cu_seqlens`` (and the snapshot slots) on the host: one device sync,
    paid by the first recurrent layer of a forward step only. A caller that knows every
    sequence has ``uniform_len`` tokens (decode: 1, verify: 1 + k) passes it: when that is
    short the plan comes from shapes alone (``uniform_plan``), with no host read -- what a
    CUDA graph can capture, and a decode step that never syncs.
    """
    if 0 < uniform_len <= recurrent_max_len:
        return uniform_plan(cu_seqlens.shape[0] - 1, device)

    def build() -> LaunchPlan:
        plan = make_plan(cu_seqlens, state_dst_slots)
        split = split_by_length(plan, recurrent_max_len)
        short_ids = index_tensor(split.short, device) if split.short else None
        chunks = build_chunk_table(plan, split.long, block_t, device) if split.long else None
        return LaunchPlan(short_ids, chunks)

    return _plans.get((cu_seqlens, state_dst_slots), (recurrent_max_len, block_t, device), build)


class VarlenLaunch(NamedTuple):
    """A batch as every Triton launcher hands it to its kernels: the plan, and the metadata
    as int32 tensors on the inputs' device."""

    plan: LaunchPlan
    cu: Tensor  # [B + 1]
    slots: Tensor  # [B]
    has_init: Tensor  # [B], 0 / 1
    dst: Tensor  # [T]; ``cu`` when there are no snapshots (a dummy pointer)
    has_dst: bool


def varlen_launch(
    states: Tensor, seqs: RecurrentBatch, recurrent_max_len: int, block_t: int, device: torch.device
) -> VarlenLaunch:
    """The launch of ``seqs`` over the pool ``states`` (updated in place: it must be contiguous)."""
    if not states.is_contiguous():
        raise ValueError("the state pool must be contiguous (it is updated in place)")
    plan = launch_plan(seqs.cu_seqlens, seqs.state_dst_slots, recurrent_max_len, block_t, device, seqs.uniform_len)

    def int32(t: Tensor) -> Tensor:
        return t.to(device=device, dtype=torch.int32)

    cu = int32(seqs.cu_seqlens)
    dst = seqs.state_dst_slots
    return VarlenLaunch(
        plan,
        cu,
        int32(seqs.slot_ids),
        int32(seqs.has_initial_state),
        cu if dst is None else int32(dst),
        dst is not None,
    )
