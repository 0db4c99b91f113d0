"""Indexed-attention cases shared by the torch-path tests (``tests/kernels/test_indexer.py``) and
the Triton path's (``tests/kernels/triton_path/test_indexer_triton.py``).

A *prompt* is every per-position tensor of one sequence (indexer queries, weights and token
keys; attention q, k, v), drawn from its own seed, so the same prompt can be packed into
batches at different chunk splits (prefix cached, new tokens). A case packs (prompt, prefix,
new) triples over a shuffled page pool (page 0 unused) holding each sequence's whole context.
The dense oracle reads the un-paged prompts with plain loops: per query, per block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels.indexer import gather_block_rows, qwen4_block_keys

Case = dict[str, object]
HI, DI, ROT = 4, 8, 4  # indexer heads, head dim, rope channels
HQ, HKV, D = 4, 2, 8  # attention heads


@dataclass(frozen=True)
class Prompt:
    idx_q: torch.Tensor  # [L, HI, DI]
    weights: torch.Tensor  # [L, HI]
    token_keys: torch.Tensor  # [L, DI]
    q: torch.Tensor  # [L, HQ, D]
    k: torch.Tensor  # [L, HKV, D]
    v: torch.Tensor  # [L, HKV, D]


def prompt(seed: int, length: int) -> Prompt:
    gen = torch.Generator().manual_seed(seed)
    return Prompt(
        *(torch.randn(length, *shape, generator=gen) for shape in ((HI, DI), (HI,), (DI,))),
        *(torch.randn(length, h, D, generator=gen) for h in (HQ, HKV, HKV)),
    )


def rope_table(length: int, rot: int = ROT) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    freqs = torch.arange(length).float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


NORM_W = torch.linspace(-0.5, 0.5, DI)


def pool_keys(rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """Qwen4 pooling of rows [..., N, C, DI], block j's rope at position j * C."""
    cos, sin = rope_table(rows.shape[-3] * block_size)
    starts = torch.arange(rows.shape[-3]) * block_size
    return qwen4_block_keys(rows, NORM_W, 1e-6, cos[starts], sin[starts])


def build_case(parts: list[tuple[Prompt, int, int]], page_size: int, seed: int = 0) -> Case:
    """parts: (prompt, cached prefix, new tokens) per sequence."""
    gen = torch.Generator().manual_seed(seed)
    ctx = [p + n for _, p, n in parts]
    pages = [max(1, math.ceil(c / page_size)) for c in ctx]
    num_pages = 1 + sum(pages) + 2
    order = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(parts), max(pages, default=1), dtype=torch.int32)
    token_pool = torch.randn(num_pages * page_size, DI, generator=gen)
    k_pool = torch.randn(num_pages * page_size, HKV, D, generator=gen)
    v_pool = torch.randn(num_pages * page_size, HKV, D, generator=gen)
    for b, (pr, _, _) in enumerate(parts):
        table[b, : pages[b]] = torch.tensor(order[: pages[b]], dtype=torch.int32)
        order = order[pages[b] :]
        locs = [int(table[b, p // page_size]) * page_size + p % page_size for p in range(ctx[b])]
        token_pool[locs], k_pool[locs], v_pool[locs] = pr.token_keys[: ctx[b]], pr.k[: ctx[b]], pr.v[: ctx[b]]
    cu = torch.zeros(len(parts) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor([n for _, _, n in parts], dtype=torch.int32), 0)

    def rows(name: str) -> torch.Tensor:
        return torch.cat([getattr(pr, name)[p : p + n] for pr, p, n in parts])

    return dict(
        parts=parts,
        idx_q=rows("idx_q"),
        weights=rows("weights"),
        q=rows("q"),
        token_pool=token_pool,
        k_pool=k_pool,
        v_pool=v_pool,
        page_table=table,
        cu_seqlens=cu,
        seq_lens=torch.tensor(ctx, dtype=torch.int32),
        page_size=page_size,
    )


def block_keys(case: Case, block_size: int) -> torch.Tensor:
    """The case's paged block keys [B, N, DI] (``gather_block_rows`` + Qwen4 pooling)."""
    rows = gather_block_rows(case["token_pool"], case["page_table"], case["page_size"], block_size)
    return pool_keys(rows, block_size)


def dense_selection(case: Case, block_size: int, top_blocks: int, tail: bool, weighted: bool) -> list[list[int]]:
    """Per packed row, the selected positions (sorted), from the un-paged prompts."""
    out = []
    for pr, prefix, new in case["parts"]:
        n_ctx = prefix + new
        n_blocks = n_ctx // block_size
        keys = pool_keys(pr.token_keys[: n_blocks * block_size].view(n_blocks, block_size, DI), block_size)
        for pos in range(prefix, prefix + new):
            visible = (pos + 1) // block_size
            scored = []
            for j in range(visible):
                total = 0.0
                for h in range(HI):
                    w = float(pr.weights[pos, h]) if weighted else 1.0
                    total += w * max(float(pr.idx_q[pos, h] @ keys[j] * PRE), 0.0)
                scored.append((-total * POST, j))
            kept = sorted(j for _, j in sorted(scored)[:top_blocks])
            chosen = [j * block_size + c for j in kept for c in range(block_size)]
            if tail:
                chosen += list(range(visible * block_size, pos + 1))
            out.append(chosen)
    return out


PRE, POST = 0.5, 1.0 / math.sqrt(DI)


def dense_attention(case: Case, selections: list[list[int]], scale: float) -> torch.Tensor:
    """Per packed row and head: softmax over the selected un-paged keys (zeros if none)."""
    out = torch.zeros(case["q"].shape)
    row = 0
    for pr, prefix, new in case["parts"]:
        for pos in range(prefix, prefix + new):
            sel = torch.tensor(selections[row], dtype=torch.long)
            for h in range(HQ):
                if len(sel):
                    kv = h // (HQ // HKV)
                    probs = torch.softmax(pr.k[sel, kv] @ pr.q[pos, h] * scale, dim=0)
                    out[row, h] = probs @ pr.v[sel, kv]
            row += 1
    return out


def as_sets(positions: torch.Tensor) -> list[list[int]]:
    """int32 [T, W] selections -> per row the listed positions, in the kernel's order."""
    return [[p for p in row if p >= 0] for row in positions.tolist()]


def select_args(case: Case, block_size: int, top_blocks: int, tail: bool, weighted: bool) -> dict:
    return dict(
        q=case["idx_q"],
        weights=case["weights"] if weighted else None,
        block_keys=block_keys(case, block_size),
        cu_seqlens=case["cu_seqlens"],
        seq_lens=case["seq_lens"],
        block_size=block_size,
        top_blocks=top_blocks,
        pre_scale=PRE,
        post_scale=POST,
        tail=tail,
    )


def attention_args(case: Case, positions: torch.Tensor, scale: float) -> dict:
    names = ("q", "k_pool", "v_pool", "page_table", "cu_seqlens", "seq_lens", "page_size")
    return dict({n: case[n] for n in names}, positions=positions, scale=scale)


MIXED = [(0, 23), (9, 1), (30, 1), (12, 5), (3, 0), (0, 1), (40, 3), (17, 9)]  # (prefix, new)


def mixed_case(page_size: int, seed: int = 0) -> Case:
    """Prefills, continuations, decode rows and an idle sequence, each its own prompt."""
    return build_case([(prompt(seed * 100 + i, p + n), p, n) for i, (p, n) in enumerate(MIXED)], page_size, seed)


def chunk_cases(seed: int, length: int, splits: list[list[int]], page_size: int) -> list[Case]:
    """The same prompt processed in each split (a list of chunk lengths summing to ``length``),
    each chunk a case (prefix = what the earlier chunks cached) beside an unrelated sequence."""
    pr, other = prompt(seed, length), prompt(seed + 1, 11)
    cases = []
    for split in splits:
        start = 0
        for n in split:
            cases.append(build_case([(other, 5, 6), (pr, start, n)], page_size, seed=start + n))
            start += n
    return cases
