"""Kernels of hybridserve: torch references (the CPU path and the ground truth), Triton
kernels for every op (recurrent ops, norms, paged attention), and FlashInfer for attention on
CUDA where it is installed and built for the head dim.

Every op is a package (``gdn``, ``kda``, ``ssd``, ``lightning`` (SSD with lightning
attention's arguments), ``selective_scan``, ``rglru``, ``conv1d``, ``norm``, ``attention``, ``mla``,
``indexer`` (the block-sparse selection and attention of Qwen4-Exp / GLM-5.3's indexed attention;
no model serves it yet))
whose ``__init__`` holds the public function and asks ``kernels.backend`` which implementation to
run: ``reference`` (torch), ``triton_*`` (imported lazily, on first use) or
``flashinfer_backend``. ``HYBRIDSERVE_KERNEL_BACKEND=auto|torch|triton`` (``auto``: the GPU
kernels on CUDA tensors, torch otherwise) and ``backend.use_backend(...)`` in tests. Launch
grids come from ``kernels.launch_grid`` (pure functions, checked against CUDA's axis limits).

Every op over a slot pool (``gdn``, ``kda``, ``ssd``, ``lightning``, ``selective_scan``,
``rglru``, ``conv1d``) is one function ``op(inputs..., states, seqs, options...)``: ``seqs`` is the
step's ``kernels.recurrent_batch.RecurrentBatch`` (``ForwardBatch.recurrent``), and the
backend runs the decode, verify or varlen form that ``seqs.path`` allows.

Conventions shared by every op (the batch layout of ``workers/forward_batch.py``):

- Flat varlen batches: B sequences, T tokens in all; ``cu_seqlens: int32 [B + 1]`` and
  sequence b owns rows ``cu_seqlens[b]:cu_seqlens[b + 1]`` of every ``[T, ...]`` tensor.
  A sequence of length 0 is allowed and leaves its state untouched.
- Recurrent pools are indexed by slot (``[S, ...]``, slot 0 a dummy): ``slot_ids: int32 [B]``
  is each sequence's live slot; ``has_initial_state: bool [B]`` says whether to read the
  initial state from it (zeros otherwise). The state after a sequence's last token is
  written back into its live slot, in place.
- ``state_dst_slots: int32 [T] | None``: where ``state_dst_slots[t] != 0`` the state after
  token t is ALSO written into that slot (prefix-cache checkpoints, speculative verify).
- All initial states are read before any state is written, so the result does not depend on
  the order sequences are processed in. Live slots must be distinct within a batch, and a
  snapshot slot must not be another sequence's live slot.
- Recurrent math runs in float32; outputs come back in the input dtype and states are stored
  in the pool's dtype.
- Batch-metadata tensors (``cu_seqlens``, ``state_dst_slots``, ``page_table``, ``seq_lens``)
  are not modified in place once a forward step starts: the GPU paths memoise the host-side
  plans built from them on their identity (``kernels.memo``), so only the first layer of a
  step syncs.

This module also holds ``scan_varlen``, the driver shared by the GDN, SSD and Mamba1
selective-scan references: it splits a varlen batch into short sequences (one padded, batched
per-token recurrence) and long ones (split at snapshot positions into segments, each run
chunked or recurrent by length).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import Tensor

# Called with (step i, state after step i [n, ...]) by a recurrent fn.
OnStep = Callable[[int, Tensor], None]
# (padded inputs, each [n, L, ...]; valid [n, L] bool; initial state [n, ...] fp32, may be
#  updated in place; on_step or None) -> (out [n, L, ...], state [n, ...])
RecurrentFn = Callable[[tuple[Tensor, ...], Tensor, Tensor, OnStep | None], tuple[Tensor, Tensor]]
# (inputs of one segment, each [L, ...]; initial state [...] fp32) -> (out [L, ...], state [...])
ChunkedFn = Callable[[tuple[Tensor, ...], Tensor], tuple[Tensor, Tensor]]


class SeqPlan(NamedTuple):
    """Host copies of the per-sequence metadata (one sync per op call)."""

    starts: list[int]
    lens: list[int]
    dst: list[int] | None  # state_dst_slots as a list, or None


def make_plan(cu_seqlens: Tensor, state_dst_slots: Tensor | None) -> SeqPlan:
    cu = cu_seqlens.tolist()
    lens = [cu[b + 1] - cu[b] for b in range(len(cu) - 1)]
    if any(n < 0 for n in lens):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu}")
    dst = state_dst_slots.tolist() if state_dst_slots is not None else None
    if dst is not None and len(dst) != cu[-1]:
        raise ValueError(f"state_dst_slots has {len(dst)} entries, expected T={cu[-1]}")
    return SeqPlan(cu[:-1], lens, dst)


def gather_initial_states(states: Tensor, slot_ids: Tensor, has_initial_state: Tensor, seqs: list[int]) -> Tensor:
    """``[n, ...]`` float32 copies of the live slots of ``seqs``, zeroed where there is no
    initial state (masked_fill, not multiply: such a slot may hold garbage, even NaN)."""
    s0 = states[pick_seqs(slot_ids.long(), seqs)].float()
    missing = ~pick_seqs(has_initial_state.to(device=s0.device, dtype=torch.bool), seqs)
    return s0.masked_fill_(missing.view(-1, *([1] * (s0.dim() - 1))), 0.0)


def pick_seqs(per_seq: Tensor, seqs: list[int]) -> Tensor:
    """``per_seq[seqs]`` ([B, ...] -> [n, ...]); ``per_seq`` itself when ``seqs`` is 0..B-1."""
    if len(seqs) == per_seq.shape[0] and seqs == list(range(len(seqs))):
        return per_seq
    return per_seq[torch.tensor(seqs, device=per_seq.device)]


def split_at_snapshots(start: int, end: int, dst: list[int] | None) -> list[tuple[int, int, int]]:
    """Rows ``start:end`` cut after every token with a snapshot slot: ``(s, e, dst_slot or 0)``."""
    if dst is None:
        return [(start, end, 0)]
    segments, s = [], start
    for t in range(start, end):
        if dst[t] != 0:
            segments.append((s, t + 1, dst[t]))
            s = t + 1
    if s < end:
        segments.append((s, end, 0))
    return segments


def scan_varlen(
    inputs: tuple[Tensor, ...],
    out: Tensor,
    states: Tensor,
    cu_seqlens: Tensor,
    slot_ids: Tensor,
    has_initial_state: Tensor,
    state_dst_slots: Tensor | None,
    recurrent_fn: RecurrentFn,
    chunked_fn: ChunkedFn,
    recurrent_max_len: int,
) -> None:
    """Run a recurrent scan over a varlen batch; fills ``out`` ([T, ...] fp32) and ``states``.

    Sequences of length ``1..recurrent_max_len`` run together through ``recurrent_fn`` (padded,
    snapshots written per step); longer ones run one by one, split at snapshot positions.
    ``recurrent_fn`` may update the state it is given in place (the driver passes fresh copies):
    at real model sizes a state-sized allocation costs more than the step's arithmetic.
    """
    plan = make_plan(cu_seqlens, state_dst_slots)
    short = [b for b, n in enumerate(plan.lens) if 0 < n <= recurrent_max_len]
    longs = [b for b, n in enumerate(plan.lens) if n > recurrent_max_len]
    # Every initial state is read before the first write.
    s0_short = gather_initial_states(states, slot_ids, has_initial_state, short) if short else None
    s0_long = gather_initial_states(states, slot_ids, has_initial_state, longs) if longs else None
    live = slot_ids.long()
    if short:
        s_short = _run_short(inputs, out, states, plan, short, s0_short, recurrent_fn)
        states[pick_seqs(live, short)] = s_short.to(states.dtype)
    for i, b in enumerate(longs):
        s_final = _run_long(inputs, out, states, plan, b, s0_long[i], recurrent_fn, chunked_fn, recurrent_max_len)
        states[live[b]] = s_final.to(states.dtype)


def _run_short(
    inputs: tuple[Tensor, ...],
    out: Tensor,
    states: Tensor,
    plan: SeqPlan,
    seqs: list[int],
    s0: Tensor,
    recurrent_fn: RecurrentFn,
) -> Tensor:
    """Batched per-token recurrence over short sequences padded to the longest; -> [n, ...].

    Sequences of one length on adjacent rows (a speculative verify, decodes with snapshots)
    need no padding: their inputs and outputs are reshaped row ranges, not gathers.
    """
    device = out.device
    n, width, first = len(seqs), max(plan.lens[b] for b in seqs), plan.starts[seqs[0]]
    if all(plan.lens[b] == width and plan.starts[b] == first + i * width for i, b in enumerate(seqs)):
        flat = slice(first, first + n * width)
        valid = torch.ones(n, width, dtype=torch.bool, device=device)

        def pad(x: Tensor) -> Tensor:
            return x[flat].reshape(n, width, *x.shape[1:])

        o, s_final = recurrent_fn(tuple(pad(x) for x in inputs), valid, s0, _snapshot_writer(states, plan, seqs, pad))
        out[flat] = o.reshape(n * width, *o.shape[2:])
        return s_final
    lens = torch.tensor([plan.lens[b] for b in seqs], device=device)
    starts = torch.tensor([plan.starts[b] for b in seqs], device=device)
    pos = torch.arange(width, device=device)
    valid = pos[None, :] < lens[:, None]  # [n, L]
    rows = starts[:, None] + torch.minimum(pos[None, :], lens[:, None] - 1)  # [n, L]
    on_step = _snapshot_writer(states, plan, seqs, lambda x: torch.where(valid, x[rows], 0))
    o, s_final = recurrent_fn(tuple(x[rows] for x in inputs), valid, s0, on_step)
    out[rows[valid]] = o[valid]
    return s_final


def _snapshot_writer(states: Tensor, plan: SeqPlan, seqs: list[int], pad: Callable[[Tensor], Tensor]) -> OnStep | None:
    """Per-step callback writing the state after step i into its snapshot slots (if any).

    ``pad`` maps a per-row [T] tensor to the padded [n, L] layout, 0 on padding steps.
    """
    if plan.dst is None:
        return None
    steps = {i for b in seqs for i in range(plan.lens[b]) if plan.dst[plan.starts[b] + i] != 0}
    if not steps:
        return None
    dst_pad = pad(torch.tensor(plan.dst, device=states.device, dtype=torch.long))  # [n, L]

    def write(i: int, s: Tensor) -> None:
        if i in steps:
            sel = dst_pad[:, i] != 0
            states[dst_pad[sel, i]] = s[sel].to(states.dtype)

    return write


def _run_long(
    inputs: tuple[Tensor, ...],
    out: Tensor,
    states: Tensor,
    plan: SeqPlan,
    b: int,
    s: Tensor,
    recurrent_fn: RecurrentFn,
    chunked_fn: ChunkedFn,
    recurrent_max_len: int,
) -> Tensor:
    """One long sequence, segment by segment; each segment chunked or recurrent by its length."""
    start = plan.starts[b]
    for seg_start, seg_end, dst_slot in split_at_snapshots(start, start + plan.lens[b], plan.dst):
        seg = tuple(x[seg_start:seg_end] for x in inputs)
        if seg_end - seg_start > recurrent_max_len:
            o, s = chunked_fn(seg, s)
        else:
            valid = torch.ones(1, seg_end - seg_start, dtype=torch.bool, device=out.device)
            o, s = recurrent_fn(tuple(x[None] for x in seg), valid, s[None].clone(), None)
            o, s = o[0], s[0]
        out[seg_start:seg_end] = o
        if dst_slot != 0:
            states[dst_slot] = s.to(states.dtype)
    return s


def run_chunks(
    chunk_fn: Callable[..., tuple[Tensor, Tensor]], inputs: tuple[Tensor, ...], s: Tensor, chunk_size: int
) -> tuple[Tensor, Tensor]:
    """A segment's chunked form: ``chunk_fn(*chunk_inputs, s) -> (out, s)`` over consecutive
    chunks of at most ``chunk_size`` rows of every input; -> (out [L, ...], final state)."""
    outs = []
    for c0 in range(0, inputs[0].shape[0], chunk_size):
        o, s = chunk_fn(*(x[c0 : c0 + chunk_size] for x in inputs), s)
        outs.append(o)
    return torch.cat(outs, dim=0), s


# Re-exported ops. Imported last: the op modules import the helpers above from this package.
from kernels.attention import paged_attention  # noqa: E402
from kernels.conv1d import causal_conv1d  # noqa: E402
from kernels.gdn import gated_delta_rule  # noqa: E402
from kernels.norm import gated_rms_norm, rms_norm  # noqa: E402
from kernels.selective_scan import mamba_selective_scan  # noqa: E402
from kernels.ssd import ssd_scan  # noqa: E402

__all__ = [
    "causal_conv1d",
    "gated_delta_rule",
    "gated_rms_norm",
    "mamba_selective_scan",
    "paged_attention",
    "rms_norm",
    "run_chunks",
    "scan_varlen",
    "ssd_scan",
]
