"""The greedy MTP draft chain as one compiled call per batch-size bucket.

After the drafter's catch-up forward, a drafting sequence holds h = the head's output at its
last row (position p), and d_1 = argmax(lm_head(h)); chained step j = 1 .. k-1 runs MTP layer
``j % N`` on (h, d_j) at position p + j and drafts d_{j+1}. ``MtpDrafter._chain`` runs that
as k logits / argmaxes and k - 1 head forwards built on the host; here the whole chain is one
compiled callable (inductor on CPU, CUDA graphs on GPU) of static shapes per bucket: B
sequences padded to a size of ``compile.batch_sizes``. Greedy only (a sampled draft needs the
request's generator and keeps its distribution): a batch with a sampling request, or larger
than every bucket, takes the eager chain.

Rows past the model length (a chained row of a sequence near ``max_model_len``, which the
eager chain drops) are clamped to the last position and write KV location 0: their drafts
are never verified (the scheduler caps a verify's drafts at the model length). Padding
sequences: hidden zeros, position p = 0, page-table row of page 0; their drafts are dropped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from configs.schema import CompileConfig
from kernels import native_ops
from workers.compiled.cache import (
    CallOptions,
    check_owner,
    compile_for_owner,
    compile_kwargs,
    configure_cache,
    new_owner,
)
from workers.compiled.progress import CompileProgress, timed
from workers.compiled.steps import CPU_MAX_PAGES, MIN_PAGES, max_symbolic_pages, pad_if_needed
from workers.device_pools import DevicePools
from workers.forward_batch import ForwardBatch
from workers.spec.draft_vocab import DraftVocab

logger = logging.getLogger(__name__)


class CompiledChain:
    """k greedy drafts for B sequences in one call (forward thread only): ``run`` from the
    head's output at each sequence's last row, ``run_verified`` from a verify's rows (the
    head's catch-up included). ``num_calls[size]`` / ``num_verify_calls[size]`` count them."""

    def __init__(
        self,
        mtp: torch.nn.Module,
        target: torch.nn.Module,
        pools: DevicePools,
        config: CompileConfig,
        device: torch.device,
        num_drafts: int,
        page_size: int,
        max_model_len: int,
        max_pages: int,
        vocab: DraftVocab | None = None,
    ) -> None:
        self.mtp, self.target, self.pools, self.device = mtp, target, pools, device
        self.vocab = vocab or DraftVocab()
        self.sizes = tuple(config.batch_sizes)
        self.k, self.page_size, self.max_model_len = num_drafts, page_size, max_model_len
        self.num_layers = int(getattr(mtp, "num_layers", 1))
        self.max_pages = max(max_pages, MIN_PAGES)
        self.on_gpu = device.type == "cuda"
        self.freeze = config.pack_weights and not self.on_gpu
        configure_cache(config.cache_dir)
        if not self.on_gpu:
            native_ops.load()  # the pool writes in C++ (kernels/native_ops.py)
        self.owner = new_owner()
        kwargs = compile_kwargs(self.on_gpu, self.freeze, gemm_templates=False)  # ATen GEMMs (see there)
        self._compiled: Callable[[Tensor, Tensor, Tensor, int], Tensor] = compile_for_owner(
            self._chain_from, self.owner, dynamic=None, fullgraph=True, **kwargs
        )
        self._compiled_verify: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, int], Tensor] = compile_for_owner(
            self._verify_chain, self.owner, dynamic=None, fullgraph=True, **kwargs
        )
        self._call = CallOptions(freeze=self.freeze, cpp_wrapper=not self.on_gpu)
        self.num_calls = {size: 0 for size in self.sizes}
        self.num_verify_calls = {size: 0 for size in self.sizes}

    # -- traced: every batch is built from a few tensors inside the graph (few inputs to
    # -- guard, no host work per step) ---------------------------------------------------------
    def _verify_chain(
        self, hidden_rows: Tensor, ids: Tensor, starts: Tensor, widths: Tensor, table: Tensor, owner: int
    ) -> Tensor:
        """The drafter's whole work after a verify of R rows per sequence: the head's catch-up
        on every row (x_{s+1} = ``ids`` [B, R], the target's hidden ``hidden_rows`` [B*R, H],
        rows from position ``starts`` [B], the first ``widths`` [B] of them accepted + 1), then
        the chain from each sequence's last accepted row. Rows past ``widths`` write KV
        location 0 (their outputs are dropped)."""
        check_owner(owner)
        size, rows = ids.shape
        ps, dev = self.page_size, self.device
        pos = starts[:, None] + torch.arange(rows, device=dev)  # [B, R]
        index = (pos // ps).clamp(max=table.shape[1] - 1)
        page = table.long().gather(1, index)
        out_loc = torch.where(torch.arange(rows, device=dev) < widths[:, None], page * ps + pos % ps, 0)
        cu = torch.arange(0, size * rows + 1, rows, dtype=torch.int32, device=dev)
        flat_ids = ids.reshape(-1)
        catch_up = ForwardBatch(
            input_ids=flat_ids,
            positions=pos.reshape(-1),
            cu_seqlens=cu,
            seq_lens=(starts + rows).to(torch.int32),
            out_loc=out_loc.reshape(-1),
            page_table=table,
            mamba_slot_ids=cu[:-1] * 0,
            has_initial_state=cu[:-1] < 0,
            logits_indices=flat_ids,
            page_size=ps,
        )
        out = self.mtp.forward_tokens(flat_ids, catch_up, hidden_rows, self.pools, layer=0)
        last = torch.arange(size, device=dev) * rows + widths - 1
        return self._chain(out[last], self._batches(starts + widths - 1, table))

    def _chain_from(self, hidden: Tensor, last_pos: Tensor, table: Tensor, owner: int) -> Tensor:
        """hidden [B, H] at position ``last_pos`` [B] -> drafts [B, k]."""
        check_owner(owner)
        return self._chain(hidden, self._batches(last_pos, table))

    def _chain(self, hidden: Tensor, batches: tuple[ForwardBatch, ...]) -> Tensor:
        """hidden [B, H] at position p -> drafts [B, k] (``batches[j-1]``: step j's rows)."""
        tokens = self._argmax(hidden)
        drafts = [tokens]
        for j, fb in enumerate(batches, 1):
            hidden = self.mtp.forward_tokens(tokens, fb, hidden, self.pools, layer=j % self.num_layers)
            tokens = self._argmax(hidden)
            drafts.append(tokens)
        return torch.stack(drafts, dim=1)

    def _argmax(self, hidden: Tensor) -> Tensor:
        """The greedy draft of each row, over the drafter's vocabulary (``DraftVocab``)."""
        return self.vocab.tokens(self.vocab.logits(self.target, hidden).argmax(dim=-1))

    def _batches(self, last_pos: Tensor, table: Tensor) -> tuple[ForwardBatch, ...]:
        """The k - 1 chained steps' batches: step j's row of sequence b sits at last_pos + j."""
        size, ps, dev = last_pos.shape[0], self.page_size, self.device
        cu = torch.arange(size + 1, dtype=torch.int32, device=dev)
        unused = torch.zeros(size, dtype=torch.int64, device=dev)  # input_ids: fed apart
        batches = []
        for j in range(1, self.k):
            ahead = last_pos + j
            pos = ahead.clamp(max=self.max_model_len - 1)
            index = (pos // ps).clamp(max=table.shape[1] - 1)  # padding rows' page 0
            page = table.long().gather(1, index[:, None])[:, 0]
            loc = torch.where(ahead < self.max_model_len, page * ps + pos % ps, 0)
            batches.append(
                ForwardBatch(
                    input_ids=unused,
                    positions=pos,
                    cu_seqlens=cu,
                    seq_lens=(pos + 1).to(torch.int32),
                    out_loc=loc,
                    page_table=table,
                    mamba_slot_ids=cu[:-1] * 0,
                    has_initial_state=cu[:-1] < 0,
                    logits_indices=unused,
                    page_size=ps,
                )
            )
        return tuple(batches)

    # -- host side ---------------------------------------------------------------------------
    @property
    def num_recompiles(self) -> int:
        return self._call.num_recompiles

    def pick(self, num_seqs: int, greedy: bool, width: int) -> int | None:
        """The bucket a chain of ``num_seqs`` sequences whose widest page table has ``width``
        pages runs in, or None (eager)."""
        if not greedy or (not self.on_gpu and width > CPU_MAX_PAGES):
            return None
        return next((size for size in self.sizes if size >= num_seqs), None)

    def _table(self, page_ids: list[list[int]] | Tensor, size: int) -> Tensor:
        """The page table padded to ``size`` rows (and on GPU to the widest table): from host
        lists, or from the step's own table on the device (no host lists per step)."""
        if isinstance(page_ids, Tensor):
            n, width = page_ids.shape
            pages = self.max_pages if self.on_gpu else max(int(width), MIN_PAGES)
            table = F.pad(page_ids, (0, pages - int(width), 0, size - int(n)))
        else:
            width = max(max((len(p) for p in page_ids), default=0), MIN_PAGES)
            pages = self.max_pages if self.on_gpu else width
            table = torch.tensor(
                [p + [0] * (pages - len(p)) for p in page_ids] + [[0] * pages] * (size - len(page_ids)),
                dtype=torch.int32,
                device=self.device,
            )
        if not self.on_gpu:
            torch._dynamo.mark_dynamic(table, 1, min=MIN_PAGES, max=max_symbolic_pages(self.max_pages))
        return table

    def run(self, hidden: Tensor, last_pos: list[int], page_ids: list[list[int]], size: int) -> Tensor:
        """Drafts [n, k] of n sequences whose last caught-up row is ``last_pos`` (hidden [n, H])."""
        n = len(last_pos)
        table = self._table(page_ids, size)
        pos = torch.tensor(last_pos + [0] * (size - n), dtype=torch.int64, device=self.device)
        hidden = pad_if_needed(hidden, (0, 0, 0, size - n))
        drafts = self._call.call(self._compiled, hidden, pos, table, self.owner)
        self.num_calls[size] += 1
        return drafts[:n].clone() if self.on_gpu else drafts[:n]

    def run_verified(
        self,
        hidden_rows: Tensor,
        next_ids: list[list[int]],
        starts: list[int],
        page_ids: list[list[int]] | Tensor,
        size: int,
    ) -> Tensor:
        """Drafts [n, k] after a verify of R = k + 1 rows per sequence (``hidden_rows`` [n*R, H]):
        sequence b accepted ``len(next_ids[b]) - 1`` drafts, its rows from position
        ``starts[b]`` continue with ``next_ids[b]``. Padding sequences: one row at position 0
        of page 0 (KV location 0); their drafts are dropped."""
        n, rows = len(starts), self.k + 1
        ids = torch.tensor(
            [x + [0] * (rows - len(x)) for x in next_ids] + [[0] * rows] * (size - n),
            dtype=torch.int64,
            device=self.device,
        )
        # one host->device copy for both: starts and widths (padding: 0 and 1)
        meta = torch.tensor(
            [starts + [0] * (size - n), [len(x) for x in next_ids] + [1] * (size - n)],
            dtype=torch.int64,
            device=self.device,
        )
        hidden = pad_if_needed(hidden_rows, (0, 0, 0, (size - n) * rows))
        drafts = self._call.call(
            self._compiled_verify, hidden, ids, meta[0], meta[1], self._table(page_ids, size), self.owner
        )
        self.num_verify_calls[size] += 1
        return drafts[:n].clone() if self.on_gpu else drafts[:n]

    def warm_up(self, hidden_size: int, dtype: torch.dtype, progress: CompileProgress | None = None) -> float:
        """Compile every bucket now (chains of padding sequences: after a catch-up, and after a
        verify), a line per graph on ``progress``; returns the seconds taken."""
        start = time.monotonic()
        empty = torch.zeros(0, hidden_size, dtype=dtype, device=self.device)
        for size in self.sizes:
            with timed(progress, f"draft chain (k={self.k}), batch {size}"), torch.inference_mode():
                self.run(empty, [], [], size)
            label = f"draft chain after a verify (k={self.k}), batch {size}"
            with timed(progress, label), torch.inference_mode():
                self.run_verified(empty, [], [], [], size)
            self.num_calls[size] -= 1
            self.num_verify_calls[size] -= 1
        self._call.warm = True  # guards are skipped from now on (CallOptions)
        seconds = time.monotonic() - start
        logger.info("compiled %d draft chains in %.1f s", len(self.sizes), seconds)
        return seconds
