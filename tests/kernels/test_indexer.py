"""``kernels.indexer`` on the torch path: the reference against a dense, un-paged, loop-by-loop
oracle (``tests/kernels/indexer_cases.py``), the prefix property the prefix cache relies on,
and transformers' Qwen4-Exp / GLM-5.3-Flash indexers and attention on random tensors."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from kernels.indexer import gather_block_rows, glm5_block_keys, qwen4_block_keys, select_positions
from kernels.indexer.reference import select_positions_torch, sparse_attention_torch
from tests.kernels import indexer_cases as ic

SCALE = 0.3


def check_case(case, block_size: int, top_blocks: int, tail: bool, weighted: bool) -> torch.Tensor:
    positions = select_positions_torch(**ic.select_args(case, block_size, top_blocks, tail, weighted))
    want = ic.dense_selection(case, block_size, top_blocks, tail, weighted)
    assert ic.as_sets(positions) == want
    out = sparse_attention_torch(**ic.attention_args(case, positions, SCALE))
    torch.testing.assert_close(out, ic.dense_attention(case, want, SCALE), atol=1e-5, rtol=0)
    return positions


@pytest.mark.parametrize("page_size", [1, 3, 4, 16])
@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("weighted", [True, False], ids=["glm_weights", "qwen_sum"])
def test_mixed_batch(page_size, tail, weighted):
    """Prefills, continuations, decode rows, an idle sequence; pages shuffled in the pool."""
    check_case(ic.mixed_case(page_size, seed=page_size), 4, 3, tail, weighted)


@pytest.mark.parametrize("block_size, top_blocks", [(1, 5), (2, 4), (8, 2), (5, 1)])
def test_block_sizes(block_size, top_blocks):
    check_case(ic.mixed_case(4, seed=block_size), block_size, top_blocks, True, True)


def test_k_larger_than_context():
    """top_blocks past every context: each row keeps all its positions 0 .. p."""
    case = ic.mixed_case(4, seed=7)
    positions = check_case(case, 4, 50, True, False)
    _, q_pos = ic_rows(case)
    assert ic.as_sets(positions) == [list(range(p + 1)) for p in q_pos]


def ic_rows(case) -> tuple[list[int], list[int]]:
    seqs, pos = [], []
    for b, (_, prefix, new) in enumerate(case["parts"]):
        seqs += [b] * new
        pos += list(range(prefix, prefix + new))
    return seqs, pos


def test_page_layout_does_not_matter():
    """Two different page shuffles of the same batch select and attend identically."""
    parts = [(ic.prompt(i, p + n), p, n) for i, (p, n) in enumerate(ic.MIXED)]
    results = []
    for seed in (1, 2):
        case = ic.build_case(parts, 4, seed)
        positions = select_positions_torch(**ic.select_args(case, 4, 3, True, True))
        results.append((positions, sparse_attention_torch(**ic.attention_args(case, positions, SCALE))))
    assert torch.equal(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1], atol=1e-6, rtol=0)


SPLITS = [[37], [5, 1, 14, 17], [16, 16, 5], [33, 1, 1, 1, 1]]


def split_rows(select, length: int, page_size: int, tail: bool = True) -> list[list[list[int]]]:
    """Per split, the prompt's per-position selections gathered from its chunks."""
    per_split, cases = [], iter(ic.chunk_cases(3, length, SPLITS, page_size))
    for split in SPLITS:
        rows = []
        for n in split:
            case = next(cases)
            positions = select(**ic.select_args(case, 4, 3, tail, True))
            rows += ic.as_sets(positions)[-n:]  # the prompt is the batch's second sequence
        per_split.append(rows)
    return per_split


@pytest.mark.parametrize("page_size", [1, 4])
def test_selection_is_a_function_of_the_prefix(page_size):
    """One chunk, several chunks, a prefix-cache hit then decodes: the same positions per row."""
    per_split = split_rows(select_positions_torch, 37, page_size)
    assert all(rows == per_split[0] for rows in per_split[1:])
    whole = ic.build_case([(ic.prompt(3, 37), 0, 37)], page_size)
    assert per_split[0] == ic.dense_selection(whole, 4, 3, True, True)


def test_ties_go_to_the_lower_block():
    """Equal scores (equal keys; all-zero relu) keep the lowest block indices."""
    cu, lens = torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([30, 30], dtype=torch.int32)
    q = torch.stack([torch.ones(2, 4), -torch.ones(2, 4)])  # row 0: equal positive scores; row 1: all zero
    keys = torch.ones(2, 8, 4)
    positions = select_positions_torch(q, None, keys, cu, lens, 4, 2, tail=False)
    assert ic.as_sets(positions) == [list(range(8)), list(range(8))]


def test_no_tail_rows_before_the_first_block_attend_nothing():
    case = ic.build_case([(ic.prompt(5, 6), 0, 6)], 4)
    positions = select_positions_torch(**ic.select_args(case, 4, 2, False, True))
    assert ic.as_sets(positions)[:3] == [[], [], []]
    out = sparse_attention_torch(**ic.attention_args(case, positions, SCALE))
    assert torch.equal(out[:3], torch.zeros_like(out[:3]))


def test_mla_views():
    """MLA: one KV head whose key is the whole latent row and whose value its first R channels."""
    case = ic.mixed_case(4, seed=11)
    positions = select_positions_torch(**ic.select_args(case, 4, 3, True, True))
    latent = case["k_pool"].reshape(-1, 1, ic.HKV * ic.D)  # [L, 1, 16]: R = 10 value channels
    q = torch.randn(case["q"].shape[0], 3, ic.HKV * ic.D)
    args = dict(ic.attention_args(case, positions, SCALE), q=q, k_pool=latent, v_pool=latent[..., :10])
    out = sparse_attention_torch(**args)
    dense = dict(args, k_pool=latent.clone(), v_pool=latent[..., :10].clone())
    torch.testing.assert_close(out, sparse_attention_torch(**dense), atol=0, rtol=0)
    row = 0
    for pr, prefix, new in case["parts"]:
        full = pr.k.reshape(-1, ic.HKV * ic.D)
        for _ in range(new):
            sel = [p for p in positions[row].tolist() if p >= 0]
            probs = torch.softmax(q[row] @ full[sel].T * SCALE, dim=-1)
            torch.testing.assert_close(out[row], probs @ full[sel, :10], atol=1e-5, rtol=0)
            row += 1


def test_dispatcher_torch_path():
    case = ic.mixed_case(4, seed=2)
    args = ic.select_args(case, 4, 3, True, True)
    assert torch.equal(select_positions(**args), select_positions_torch(**args))


def test_pooling_gathers_through_the_page_table():
    case = ic.build_case([(ic.prompt(9, 13), 0, 13)], 3)
    rows = gather_block_rows(case["token_pool"], case["page_table"], 3, 4)  # 5 pages x 3 / 4 = 3 blocks
    assert rows.shape == (1, 3, 4, ic.DI)
    torch.testing.assert_close(rows[0], case["parts"][0][0].token_keys[:12].view(3, 4, ic.DI), atol=0, rtol=0)


# --- transformers -----------------------------------------------------------------------------


def causal_batch(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence of n tokens, unpaged (page_size 1, identity table)."""
    return (
        torch.arange(n, dtype=torch.int32)[None],
        torch.tensor([0, n], dtype=torch.int32),
        torch.tensor([n], dtype=torch.int32),
    )


def to_mask(positions: torch.Tensor, n: int) -> torch.Tensor:
    mask = torch.zeros(positions.shape[0], n + 1, dtype=torch.bool)
    mask.scatter_(1, torch.where(positions >= 0, positions.long(), n), True)
    return mask[:, :n]


def test_matches_transformers_qwen4_exp():
    """Qwen4-Exp QSA: the indexer's selected mask and the masked eager attention of one layer."""
    qwen = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")
    torch.manual_seed(0)
    n, hidden, block, budget, dim, rot = 41, 32, 4, 12, 16, 8
    cfg = SimpleNamespace(
        indexer_n_heads=8,
        indexer_kv_heads=1,
        indexer_head_dim=dim,
        indexer_budget=budget,
        indexer_compress_ratio=block,
        hidden_size=hidden,
        rms_norm_eps=1e-6,
    )
    indexer = qwen.Qwen4ExpTextQSAIndexer(cfg, 0).eval()
    indexer.k_layernorm.weight.data.normal_(0, 0.3)
    indexer.q_layernorm.weight.data.normal_(0, 0.3)
    x = torch.randn(1, n, hidden)
    cos, sin = ic.rope_table(n, rot)
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        want_mask = indexer(x, (cos[None], sin[None]), causal, None)[0, 0]
        q, raw = indexer.index_qk_proj(x).split([8 * dim, dim], dim=-1)
        q = qwen.apply_rotary_pos_emb(
            indexer.q_layernorm(q.view(1, n, 8, dim)), cos=cos[None], sin=sin[None], unsqueeze_dim=2
        )[0]
        table, cu, lens = causal_batch(n)
        rows = gather_block_rows(raw[0], table, 1, block)
        starts = torch.arange(rows.shape[1]) * block
        keys = qwen4_block_keys(rows, indexer.k_layernorm.weight, 1e-6, cos[starts], sin[starts])
        positions = select_positions_torch(
            q, None, keys, cu, lens, block, budget // block, post_scale=1 / math.sqrt(dim)
        )
    assert torch.equal(to_mask(positions, n), want_mask)

    hq, hkv, hd = 4, 2, 8
    qa, ka, va = torch.randn(n, hq, hd), torch.randn(n, hkv, hd), torch.randn(n, hkv, hd)
    bias = torch.zeros(n, n).masked_fill(~(causal[0, 0] & want_mask), torch.finfo(torch.float32).min)
    stub = SimpleNamespace(num_key_value_groups=hq // hkv, training=False)
    want, _ = qwen.eager_attention_forward(
        stub, qa.transpose(0, 1)[None], ka.transpose(0, 1)[None], va.transpose(0, 1)[None], bias[None, None], SCALE
    )
    out = sparse_attention_torch(qa, ka, va, positions, table, cu, lens, 1, SCALE)
    torch.testing.assert_close(out, want[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("tail", [True, False])
def test_matches_transformers_glm5_next(tail):
    """GLM-5.3-Flash DSA k-pool: the indexer's selected indices (as sets) over a one-sequence prefill."""
    glm = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")
    torch.manual_seed(1)
    n, hidden, block, topk, dim, heads, rank = 37, 32, 4, 12, 16, 8, 24
    cfg = SimpleNamespace(
        hidden_size=hidden,
        index_n_heads=heads,
        index_head_dim=dim,
        qk_rope_head_dim=8,
        index_topk=topk,
        q_lora_rank=rank,
        index_kpool=block,
        index_kpool_always_select_tail=tail,
    )
    indexer = glm.Glm5NextTextIndexer(cfg, 0).eval()
    indexer.index_kpool_compress_ape.data.normal_(0, 0.5)
    indexer.index_kpool_compress_gate.data.normal_(0, 0.3)
    x, q_resid = torch.randn(1, n, hidden), torch.randn(1, n, rank)
    with torch.no_grad():
        want = indexer(x, q_resid, torch.ones(1, n, dtype=torch.bool), None)[0]
        q = indexer.wq_b(q_resid[0]).view(n, heads, dim)
        weights = indexer.weights_proj(x[0]) * heads**-0.5
        token_rows = torch.cat([indexer.k_norm(indexer.wk(x[0])), x[0] @ indexer.index_kpool_compress_gate.T], -1)
        table, cu, lens = causal_batch(n)
        keys = glm5_block_keys(gather_block_rows(token_rows, table, 1, block), indexer.index_kpool_compress_ape)
        positions = select_positions_torch(
            q, weights, keys, cu, lens, block, topk // block, pre_scale=dim**-0.5, tail=tail
        )
    assert ic.as_sets(positions) == [sorted(p for p in row if p >= 0) for row in want.tolist()]


def test_row_chunks_and_empty_batches(monkeypatch):
    """Scoring the rows in chunks (here one row at a time) selects the same; no rows, no output."""
    from kernels.indexer import reference

    args = ic.select_args(ic.mixed_case(4, seed=4), 4, 3, True, True)
    whole = select_positions_torch(**args)
    monkeypatch.setattr(reference, "ROW_CHUNK_ELEMENTS", 1)
    assert torch.equal(select_positions_torch(**args), whole)
    empty = ic.build_case([(ic.prompt(0, 5), 5, 0)], 4)
    positions = select_positions_torch(**ic.select_args(empty, 4, 3, True, True))
    assert positions.shape == (0, 15)
    assert sparse_attention_torch(**ic.attention_args(empty, positions, SCALE)).shape == (0, ic.HQ, ic.D)


def test_traced_selection_keeps_the_block_count_dynamic():
    """A compiled step traces the torch selection with a dynamic block count N (page-table
    width): it must not specialise N (a guard on it broke GLM-5.3-Flash's compiled CPU steps)
    and selects what the eager call does, here at N = 9 and N = 2 (fewer than top_blocks)."""
    compiled = torch.compile(select_positions_torch, fullgraph=True, dynamic=False)
    args = ic.select_args(ic.mixed_case(4, seed=5), 4, 3, True, True)
    for n_blocks in (9, 2):
        keys = args["block_keys"][:, :n_blocks].contiguous()
        torch._dynamo.mark_dynamic(keys, 1)
        want = select_positions_torch(**{**args, "block_keys": keys})
        assert torch.equal(compiled(**{**args, "block_keys": keys}), want)
