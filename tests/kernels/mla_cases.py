"""MLA cases shared by the torch-path and Triton-path tests: a paged-attention case with one
KV head whose rows are latents [c (R) | k_r (P)] (``attention_cases.build_case``), and the
dense oracle whose keys are the whole rows and whose values are their first R channels."""

from __future__ import annotations

from typing import Callable

import torch

from tests.kernels.attention_cases import Case, build_case

MIXED = [(0, 70), (5, 1), (12, 1), (9, 4), (3, 0), (0, 1), (80, 3), (40, 17)]


def mla_case(
    seqs: list[tuple[int, int]], page_size: int, heads: int, latent_dim: int, rope_dim: int, seed: int
) -> Case:
    case = build_case(seqs, page_size, heads, 1, seed, head_dim=latent_dim + rope_dim)
    case["latent"] = case["k"][:, 0]
    case["pool"] = case["k_pool"]
    case["latent_dim"] = latent_dim
    return case


def dense_mla(case: Case, scale: float) -> torch.Tensor:
    """Per sequence, query and head: softmax over rows 0..its position of the un-paged
    latents, applied to their first R channels -> [T, H, R]."""
    q, r = case["q"].float(), case["latent_dim"]
    out = torch.zeros(q.shape[0], q.shape[1], r)
    for b, (prefix, new) in enumerate(case["seqs"]):
        start = int(case["cu_seqlens"][b])
        rows = case["k_full"][b][:, 0].float()  # [ctx, R + P]
        for i in range(new):
            keys = rows[: prefix + i + 1]
            probs = torch.softmax(q[start + i] @ keys.T * scale, dim=-1)  # [H, L]
            out[start + i] = probs @ keys[:, :r]
    return out


def run_mla(
    fn: Callable[..., torch.Tensor], case: Case, scale: float, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fn`` (an mla_attention implementation) on a copy of the pool -> (out, pool), on CPU."""
    dev = torch.device(device)
    names = ("q", "latent", "pool", "out_loc", "page_table", "cu_seqlens", "seq_lens")
    args = {n: case[n].clone().to(dev) for n in names}
    out = fn(**args, page_size=case["page_size"], scale=scale, latent_dim=case["latent_dim"])
    return out.cpu(), args["pool"].cpu()


def expected_pool(case: Case) -> torch.Tensor:
    pool = case["pool"].clone()
    pool[case["out_loc"], 0] = case["latent"].to(pool.dtype)
    return pool
