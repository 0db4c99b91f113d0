"""FlashInfer paged attention over our KV pool (CUDA only; ``flashinfer`` imported lazily).

Our pool ``[num_pages * page_size, Hkv, D]`` is, viewed as ``[num_pages, page_size, Hkv, D]``,
exactly FlashInfer's ``NHD`` paged layout, so no copy is made: ``run(q, (k_pages, v_pages))``.

Per call: k, v are written into the pool at ``out_loc`` (``write_kv``), then one wrapper runs:
the decode wrapper when every sequence brings one token, else the prefill wrapper (prefill,
chunked prefill, multi-token verify, mixed batches) with ``causal=True``; FlashInfer aligns
the causal mask bottom-right, which is our rule (query i of a sequence with q_len new tokens
and seq_len context sits at position seq_len - q_len + i). Sequences with no new tokens are
left out of the plan (they own no query rows).

Planning costs a host sync and some CPU work, so a plan is kept while the batch's metadata
tensors are the same live objects, unmodified: every attention layer of one forward step
reuses the first layer's plan. ``paged_kv_metadata`` is plain torch (tested on CPU).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from kernels.attention.reference import check_heads, write_kv
from kernels.memo import TensorMemo

WORKSPACE_BYTES = 128 * 1024 * 1024


class PagedKVMetadata(NamedTuple):
    """FlashInfer's CSR page description of the sequences that bring new tokens (int32).

    The indptrs and last-page lengths stay on the host (``plan`` reads them there, as vLLM
    passes them); the page ids go on the device.
    """

    qo_indptr: Tensor  # [n + 1] query rows (a subset of cu_seqlens' segments), host
    kv_indptr: Tensor  # [n + 1] into kv_indices, host
    kv_indices: Tensor  # [sum of pages] page ids, each sequence's in order, device
    kv_last_page_len: Tensor  # [n] in 1..page_size, host
    all_decode: bool  # every kept sequence brings exactly one token


def paged_kv_metadata(page_table: Tensor, cu_seqlens: Tensor, seq_lens: Tensor, page_size: int) -> PagedKVMetadata:
    """Page table + lengths -> FlashInfer metadata (one host sync: ``tolist``)."""
    cu = cu_seqlens.tolist()
    ctx = seq_lens.tolist()
    q_lens = [cu[b + 1] - cu[b] for b in range(len(ctx))]
    bad = [b for b in range(len(ctx)) if ctx[b] < q_lens[b]]
    if bad:
        raise ValueError(f"seq_lens < new tokens for sequences {bad}: {ctx} vs {q_lens}")
    keep = [b for b, n in enumerate(q_lens) if n > 0]
    num_pages = [-(-ctx[b] // page_size) for b in keep]
    if any(n > page_table.shape[1] for n in num_pages):
        raise ValueError(f"page_table has {page_table.shape[1]} columns, sequences need {num_pages} pages")
    qo_indptr, kv_indptr = [0], [0]
    for b, n in zip(keep, num_pages):
        qo_indptr.append(qo_indptr[-1] + q_lens[b])
        kv_indptr.append(kv_indptr[-1] + n)
    # flat page_table positions of every page in use, built on the host: no second sync
    pages_t = torch.tensor(num_pages, dtype=torch.long)
    rows = torch.repeat_interleave(torch.tensor(keep, dtype=torch.long), pages_t)
    firsts = torch.repeat_interleave(torch.tensor(kv_indptr[:-1], dtype=torch.long), pages_t)
    flat = rows * page_table.shape[1] + (torch.arange(kv_indptr[-1]) - firsts)
    indices = page_table.reshape(-1)[flat.to(page_table.device)].to(torch.int32)
    last = [ctx[b] - (n - 1) * page_size for b, n in zip(keep, num_pages)]

    def i32(values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.int32)

    return PagedKVMetadata(i32(qo_indptr), i32(kv_indptr), indices, i32(last), all(q_lens[b] == 1 for b in keep))


class _DeviceState:
    def __init__(self, device: torch.device) -> None:
        import flashinfer

        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode: dict[bool, Any] = {}  # by use_tensor_cores
        self.plans: TensorMemo[Any] = TensorMemo(size=1)  # the wrapper planned last

    def decode_wrapper(self, use_tensor_cores: bool) -> Any:
        import flashinfer

        if use_tensor_cores not in self.decode:
            self.decode[use_tensor_cores] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=use_tensor_cores
            )
        return self.decode[use_tensor_cores]


_states: dict[torch.device, _DeviceState] = {}


def paged_attention_flashinfer(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    out_loc: Tensor,
    page_table: Tensor,
    cu_seqlens: Tensor,
    seq_lens: Tensor,
    page_size: int,
    scale: float,
) -> Tensor:
    """Contract of ``kernels.attention.paged_attention``, run by FlashInfer."""
    check_heads(q, k)
    head_dim, num_kv_heads = q.shape[2], k.shape[1]
    write_kv(k, v, k_pool, v_pool, out_loc)
    if q.shape[0] == 0:
        return torch.empty_like(q)
    wrapper = _plan(q, k_pool, page_table, cu_seqlens, seq_lens, page_size, scale)
    pages = (k_pool.view(-1, page_size, num_kv_heads, head_dim), v_pool.view(-1, page_size, num_kv_heads, head_dim))
    return wrapper.run(q.contiguous(), pages)


def _plan(
    q: Tensor, k_pool: Tensor, page_table: Tensor, cu_seqlens: Tensor, seq_lens: Tensor, page_size: int, scale: float
) -> Any:
    """The wrapper planned for this batch: planned by the first layer of a step, reused by
    the others (``kernels.memo``; one wrapper per kind, so only the last plan is kept)."""
    state = _states.get(q.device)
    if state is None:
        state = _states[q.device] = _DeviceState(q.device)
    num_q_heads, head_dim, num_kv_heads = q.shape[1], q.shape[2], k_pool.shape[1]
    shape_key = (num_q_heads, num_kv_heads, head_dim, page_size, float(scale), q.dtype, k_pool.dtype)

    def build() -> Any:
        meta = paged_kv_metadata(page_table, cu_seqlens, seq_lens, page_size)
        common = dict(q_data_type=q.dtype, kv_data_type=k_pool.dtype, sm_scale=float(scale))
        if meta.all_decode:
            wrapper = state.decode_wrapper(use_tensor_cores=num_q_heads // num_kv_heads >= 4)
            wrapper.plan(
                meta.kv_indptr,
                meta.kv_indices,
                meta.kv_last_page_len,
                num_q_heads,
                num_kv_heads,
                head_dim,
                page_size,
                **common,
            )
        else:
            wrapper = state.prefill
            wrapper.plan(
                meta.qo_indptr,
                meta.kv_indptr,
                meta.kv_indices,
                meta.kv_last_page_len,
                num_q_heads,
                num_kv_heads,
                head_dim,
                page_size,
                causal=True,
                **common,
            )
        return wrapper

    return state.plans.get((page_table, cu_seqlens, seq_lens), shape_key, build)
