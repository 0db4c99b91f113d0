"""Paged-attention cases shared by the torch-path tests (``tests/kernels/test_attention.py``)
and the Triton kernel's (``tests/kernels/triton_path/test_attention_triton.py``): a batch of
sequences over a shuffled page pool, and naive per-sequence dense softmax attention over the
un-paged keys and values, the oracle both paths are held to."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

Case = dict[str, Any]


def build_case(seqs: list[tuple[int, int]], page_size: int, h_q: int, h_kv: int, seed: int, head_dim: int = 8) -> Case:
    """seqs: (cached prefix, new tokens) per sequence. Pages are shuffled, page 0 unused.

    The cached prefix's K/V are already in the pool; the new tokens' K/V come as ``k``, ``v``
    with ``out_loc``. ``k_full`` / ``v_full`` hold every sequence's whole context, un-paged.
    """
    gen = torch.Generator().manual_seed(seed)
    ctx = [p + n for p, n in seqs]
    pages_per_seq = [math.ceil(c / page_size) for c in ctx]
    num_pages = 1 + sum(pages_per_seq) + 2
    order = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(seqs), max(1, max(pages_per_seq, default=1)), dtype=torch.int32)
    k_full = [torch.randn(c, h_kv, head_dim, generator=gen) for c in ctx]
    v_full = [torch.randn(c, h_kv, head_dim, generator=gen) for c in ctx]
    k_pool = torch.randn(num_pages * page_size, h_kv, head_dim, generator=gen)
    v_pool = torch.randn(num_pages * page_size, h_kv, head_dim, generator=gen)
    out_loc = []
    for b, (prefix, new) in enumerate(seqs):
        table[b, : pages_per_seq[b]] = torch.tensor(order[: pages_per_seq[b]], dtype=torch.int32)
        order = order[pages_per_seq[b] :]
        locs = [int(table[b, p // page_size]) * page_size + p % page_size for p in range(ctx[b])]
        k_pool[locs[:prefix]] = k_full[b][:prefix]  # the cached prefix is already there
        v_pool[locs[:prefix]] = v_full[b][:prefix]
        out_loc += locs[prefix:]
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor([n for _, n in seqs], dtype=torch.int32), 0)
    empty = torch.zeros(0, h_kv, head_dim)
    return dict(
        q=torch.randn(int(cu[-1]), h_q, head_dim, generator=gen),
        k=torch.cat([k[p:] for k, (p, _) in zip(k_full, seqs)] or [empty]),
        v=torch.cat([v[p:] for v, (p, _) in zip(v_full, seqs)] or [empty]),
        k_pool=k_pool,
        v_pool=v_pool,
        out_loc=torch.tensor(out_loc, dtype=torch.int64),
        page_table=table,
        cu_seqlens=cu,
        seq_lens=torch.tensor(ctx, dtype=torch.int32),
        page_size=page_size,
        k_full=k_full,
        v_full=v_full,
        seqs=seqs,
    )


def dense_reference(case: Case, scale: float, window: int | None = None) -> torch.Tensor:
    """Per sequence, per query and head: softmax over the un-paged keys 0..its position (the
    last ``window`` of them with a sliding window)."""
    q = case["q"].float()
    out = torch.zeros(q.shape)
    h_q, h_kv = q.shape[1], case["k"].shape[1]
    for b, (prefix, new) in enumerate(case["seqs"]):
        start = int(case["cu_seqlens"][b])
        for i in range(new):
            pos = prefix + i
            first = 0 if window is None else max(0, pos - window + 1)
            for h in range(h_q):
                keys = case["k_full"][b][first : pos + 1, h // (h_q // h_kv)]
                vals = case["v_full"][b][first : pos + 1, h // (h_q // h_kv)]
                probs = torch.softmax(keys @ q[start + i, h] * scale, dim=0)
                out[start + i, h] = probs @ vals
    return out


def with_dtype(case: Case, dtype: torch.dtype) -> Case:
    """The case with q, k, v and the pools in ``dtype`` (the un-paged oracle inputs too)."""
    out = dict(case)
    for name in ("q", "k", "v", "k_pool", "v_pool"):
        out[name] = case[name].to(dtype)
    out["k_full"] = [k.to(dtype).float() for k in case["k_full"]]
    out["v_full"] = [v.to(dtype).float() for v in case["v_full"]]
    return out


def run_paged(
    fn: Callable[..., torch.Tensor],
    case: Case,
    scale: float,
    device: torch.device | str = "cpu",
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fn`` (a paged_attention implementation) on copies of the case's pools, on ``device``:
    -> (output, k pool, v pool), on the CPU."""
    dev = torch.device(device)
    names = ("q", "k", "v", "k_pool", "v_pool", "out_loc", "page_table", "cu_seqlens", "seq_lens")
    args = {n: case[n].clone().to(dev) for n in names}
    extra = {} if window is None else {"window": window}
    out = fn(**args, page_size=case["page_size"], scale=scale, **extra)
    return out.cpu(), args["k_pool"].cpu(), args["v_pool"].cpu()


def expected_pools(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """The pools after the new tokens' K/V are written, and nothing else."""
    k_pool, v_pool = case["k_pool"].clone(), case["v_pool"].clone()
    k_pool[case["out_loc"]] = case["k"].to(k_pool.dtype)
    v_pool[case["out_loc"]] = case["v"].to(v_pool.dtype)
    return k_pool, v_pool
