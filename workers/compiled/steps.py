"""Compiled decode and verify steps: one compiled callable per batch-size bucket.

A decode-only batch of B sequences (``ForwardBatch.decode_only``) or, under speculation, a
verify batch of B sequences of T = 1 + k rows each (``ForwardBatch.verify_len``), is
padded up to the smallest size of ``compile.batch_sizes`` that holds it, and the padded
batch runs the model's forward and ``compute_logits`` through ``torch.compile``: inductor on
CPU, inductor with CUDA graphs on GPU (``mode="reduce-overhead"``). Larger batches, prefill
and mixed batches stay eager. Ops inside take their traced formulation
(``kernels.static.tracing``: no host read, static shapes).

Padding sequences (invariant, what makes padding harmless): T rows of token 0 at position
0, T context tokens, KV location 0 (the dummy page 0), Mamba slot 0 (the dummy slot) and
snapshot slot 0, an empty page-table row; their outputs are dropped. Every op is
row- or sequence-independent, so a padding sequence never changes a real one.

Shapes: every bucket is compiled at start-up by ``warm_up``. On GPU each bucket is its own
static graph, its page table padded to the engine's maximum pages per sequence, so every
replay of a captured graph has the same shapes. On CPU the page-table width stays symbolic
(``mark_dynamic``, at least 2 pages), so one graph serves every context length, and so may
the batch dims of buckets above 1 (``mark_batch_dynamic`` at warm-up): dynamo keeps them
symbolic until the model's code branches on them (the few-rows kernel's row limit), so
buckets share a graph per range of sizes -- fewer graphs to trace at every start and to
compile at a cold one, for the same step time (BENCHMARKS.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from configs.schema import CompileConfig
from kernels import native_ops
from workers.compiled.cache import (
    CallOptions,
    cache_counters,
    check_owner,
    compile_for_owner,
    compile_kwargs,
    configure_cache,
    new_owner,
)
from workers.compiled.progress import CompileProgress, CompileTimes, timed
from workers.device_pools import DevicePools
from workers.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

MIN_PAGES = 2  # dynamo specialises sizes 0 and 1: a symbolic width starts at 2
# CPU: inductor's C++ reductions guard a dynamic length below 4,096 (``need_use_acc_helper``),
# so the symbolic page-table width stops there; a batch with a wider table runs eager.
CPU_MAX_PAGES = 4095


def max_symbolic_pages(max_pages: int) -> int:
    """The upper bound a CPU graph's page-table width is marked dynamic with."""
    return min(max_pages + 1, CPU_MAX_PAGES)


class Bucket(NamedTuple):
    size: int  # sequences, padded
    rows: int  # rows per sequence: 1 (decode) or T (verify)


class CompiledSteps:
    """The compiled steps of one model over its pools (forward thread only).

    ``num_calls[bucket]`` counts the steps each bucket ran (what tests read to see which
    path ran); ``pick(fb)`` says whether a batch takes a compiled step, ``run`` runs it.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        pools: DevicePools,
        config: CompileConfig,
        device: torch.device,
        max_pages: int,
        page_size: int,
        verify_lens: tuple[int, ...] = (),
    ) -> None:
        self.model, self.pools, self.device = model, pools, device
        self.sizes = tuple(config.batch_sizes)
        self.verify_lens = verify_lens
        self.max_pages, self.page_size = max(max_pages, MIN_PAGES), page_size
        self.on_gpu = device.type == "cuda"
        self.freeze = config.pack_weights and not self.on_gpu
        configure_cache(config.cache_dir)
        if not self.on_gpu:
            native_ops.load()  # the pool writes in C++ (kernels/native_ops.py)
        if self.on_gpu:  # captured graphs may write the pools in place
            for t in [*pools.kv.tensors(), *pools.mamba.tensors()]:
                torch._dynamo.mark_static_address(t)
        self.owner = new_owner()
        self._compiled: Callable[[ForwardBatch, int], tuple[Tensor, Tensor]] = compile_for_owner(
            self._step,
            self.owner,
            dynamic=None,
            fullgraph=True,  # static but the marked page dim
            **compile_kwargs(self.on_gpu, self.freeze, gemm_templates=not verify_lens),
        )
        self._call = CallOptions(freeze=self.freeze, cpp_wrapper=not self.on_gpu)
        # Under speculation every decode is a verify (a plain decode step is rare: a request
        # that has not drafted yet), so only the verify steps are compiled then.
        self.buckets = tuple(Bucket(size, rows) for rows in (verify_lens or (1,)) for size in self.sizes)
        self.num_calls = {bucket: 0 for bucket in self.buckets}
        self.compile_times = CompileTimes(0.0, 0.0)  # the start-up's, set by build_compiled
        self._bucket_constants: dict[Bucket, tuple[Tensor, Tensor, Tensor]] = {}

    def _step(self, fb: ForwardBatch, owner: int) -> tuple[Tensor, Tensor]:
        check_owner(owner)
        hidden = self.model.forward(fb, self.pools)
        return hidden, self.model.compute_logits(hidden)

    @property
    def num_recompiles(self) -> int:
        """Steps that compiled a graph after the warm-up (each logged)."""
        return self._call.num_recompiles

    def pick(self, fb: ForwardBatch) -> Bucket | None:
        """The bucket a batch runs in, or None: eager (another kind of batch, or too large)."""
        # a verify of 1-token rows (every row snapshotted) is no decode step: eager
        rows = 1 if fb.decode_only else (fb.verify_len if fb.verify_len > 1 else 0)
        if not self.on_gpu and fb.page_table.shape[1] > CPU_MAX_PAGES:
            return None
        return next((b for b in self.buckets if b.rows == rows and b.size >= fb.num_seqs), None)

    def run(
        self, fb: ForwardBatch, bucket: Bucket, on_enter: Callable[[], None] | None = None
    ) -> tuple[Tensor, Tensor]:
        """(hidden [T, H], logits [T, V] float32) of the T real rows, through ``bucket``;
        ``on_enter`` is called once the inputs are padded, just before the compiled call."""
        num_tokens = fb.num_tokens
        padded = self._pad(fb, bucket)
        if on_enter is not None:
            on_enter()
        hidden, logits = self._call.call(self._compiled, padded, self.owner)
        self.num_calls[bucket] += 1
        if self.on_gpu:  # a graph's outputs are rewritten by its next replay
            hidden, logits = hidden.clone(), logits.clone()
        return hidden[:num_tokens], logits[:num_tokens]

    def warm_up(self, progress: CompileProgress | None = None) -> float:
        """Compile every bucket now (batches of padding only), a line each on ``progress``;
        returns the seconds taken."""
        start = time.monotonic()
        for bucket in self.buckets:
            kind = "decode" if bucket.rows == 1 else f"verify ({bucket.rows} rows)"
            with timed(progress, f"{kind} step, batch {bucket.size}"), torch.inference_mode():
                self._call.call(self._compiled, self._pad(self._empty(bucket.rows), bucket), self.owner)
        self._call.warm = True  # guards are skipped from now on (CallOptions)
        seconds = time.monotonic() - start
        logger.info("compiled %d steps in %.1f s (cache %s)", len(self.buckets), seconds, cache_counters())
        return seconds

    # -- padding ---------------------------------------------------------------------------
    def _empty(self, rows: int) -> ForwardBatch:
        """A batch of no sequences of the kind ``rows`` names (``_pad`` fills it)."""

        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> Tensor:
            return torch.zeros(*shape, dtype=dtype, device=self.device)

        i32 = torch.int32
        return ForwardBatch(
            zeros(0),
            zeros(0),
            zeros(1, dtype=i32),
            zeros(0, dtype=i32),
            zeros(0),
            zeros(0, 1, dtype=i32),
            zeros(0, dtype=i32),
            zeros(0, dtype=torch.bool),
            zeros(0),
            self.page_size,
            state_dst_slots=None if rows == 1 else zeros(0, dtype=i32),
            decode_only=rows == 1,
            verify_len=0 if rows == 1 else rows,
        )

    def _pad(self, fb: ForwardBatch, bucket: Bucket) -> ForwardBatch:
        size, rows = bucket
        extra = size - fb.num_seqs
        width = int(fb.page_table.shape[1])
        pages = self.max_pages if self.on_gpu else max(width, MIN_PAGES)
        table = pad_if_needed(fb.page_table, (0, pages - width, 0, extra))
        if not self.on_gpu:
            torch._dynamo.mark_dynamic(table, 1, min=MIN_PAGES, max=max_symbolic_pages(self.max_pages))
        cu, has_initial, logits_indices = self._constants(bucket)
        by_row, by_seq = (0, extra * rows), (0, extra)
        dst = None if fb.state_dst_slots is None or rows == 1 else pad_if_needed(fb.state_dst_slots, by_row)
        padded = ForwardBatch(
            input_ids=pad_if_needed(fb.input_ids, by_row),
            positions=pad_if_needed(fb.positions, by_row),
            cu_seqlens=cu,
            seq_lens=pad_if_needed(fb.seq_lens, by_seq, value=rows),
            out_loc=pad_if_needed(fb.out_loc, by_row),
            page_table=table,
            mamba_slot_ids=pad_if_needed(fb.mamba_slot_ids, by_seq),
            has_initial_state=has_initial,
            logits_indices=logits_indices,
            page_size=fb.page_size,
            state_dst_slots=dst,
            decode_only=rows == 1,
            verify_len=0 if rows == 1 else rows,
        )
        # warm-up batches only (fresh tensors): a compiled graph accepts unmarked inputs, and
        # marking a caller's tensor could send it to a recompile of a static graph
        if not self.on_gpu and size > 1 and not self._call.warm:
            mark_batch_dynamic(padded)
        return padded

    def _constants(self, bucket: Bucket) -> tuple[Tensor, Tensor, Tensor]:
        """A bucket's inputs that never change (cu_seqlens, has_initial_state, logits_indices),
        built once: the graph only reads them."""
        if bucket not in self._bucket_constants:
            size, rows = bucket
            self._bucket_constants[bucket] = (
                torch.arange(0, size * rows + 1, rows, dtype=torch.int32, device=self.device),
                torch.ones(size, dtype=torch.bool, device=self.device),
                torch.arange(size * rows, device=self.device),
            )
        return self._bucket_constants[bucket]


# ForwardBatch's tensors whose dim 0 counts sequences or rows (cu_seqlens: one more)
BATCH_FIELDS = (
    "input_ids",
    "positions",
    "cu_seqlens",
    "seq_lens",
    "out_loc",
    "page_table",
    "mamba_slot_ids",
    "has_initial_state",
    "logits_indices",
    "state_dst_slots",
)


def mark_batch_dynamic(fb: ForwardBatch) -> None:
    """Let dynamo keep ``fb``'s batch dims symbolic where the traced code allows it (a weak
    mark: it specialises them where the code branches on a size, and never fails)."""
    for name in BATCH_FIELDS:
        t = getattr(fb, name)
        if t is not None:
            torch._dynamo.maybe_mark_dynamic(t, 0)


def pad_if_needed(t: Tensor, pad: tuple[int, ...], value: int = 0) -> Tensor:
    """``F.pad(t, pad, value=value)``, or ``t`` itself when nothing is padded and ``t`` is
    what the graph's guards saw at warm-up (a fresh padded copy made in inference mode: a
    contiguous inference tensor; another kind would make dynamo compile another graph)."""
    if not any(pad) and t.is_contiguous() and t.is_inference():
        return t
    return F.pad(t, pad, value=value)
