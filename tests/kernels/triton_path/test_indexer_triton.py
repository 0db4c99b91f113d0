"""The Triton indexer kernels (``kernels/indexer/triton_select.py``, ``triton_sparse.py``) against
the torch reference and the dense oracle (``tests/kernels/indexer_cases.py``). The selections
must be equal, not close: the kernel and the reference both break ties to the lower block."""

from __future__ import annotations

import pytest
import torch

from kernels.indexer.reference import select_positions_torch, sparse_attention_torch
from tests.kernels import indexer_cases as ic
from tests.kernels.test_indexer import SPLITS, split_rows

SCALE = 0.3


def triton_select(**kwargs) -> torch.Tensor:
    from kernels.indexer.triton_select import select_positions_triton

    return select_positions_triton(**on_device(kwargs)).cpu()


def triton_attend(**kwargs) -> torch.Tensor:
    from kernels.indexer.triton_sparse import sparse_attention_triton

    return sparse_attention_triton(**on_device(kwargs)).cpu()


def on_device(kwargs: dict) -> dict:
    from tests.kernels.triton_path.conftest import DEVICE

    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


def check_case(case, block_size: int, top_blocks: int, tail: bool, weighted: bool, atol: float) -> torch.Tensor:
    args = ic.select_args(case, block_size, top_blocks, tail, weighted)
    positions = triton_select(**args)
    assert torch.equal(positions, select_positions_torch(**args))
    assert ic.as_sets(positions) == ic.dense_selection(case, block_size, top_blocks, tail, weighted)
    out = triton_attend(**ic.attention_args(case, positions, SCALE))
    torch.testing.assert_close(
        out, sparse_attention_torch(**ic.attention_args(case, positions, SCALE)), atol=atol, rtol=0
    )
    return positions


@pytest.fixture(scope="module")
def atol(device) -> float:
    return 1e-5 if device.type == "cpu" else 1e-4


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("tail, weighted", [(True, True), (False, False)], ids=["glm_tail", "qwen_no_tail"])
def test_mixed_batch(page_size, tail, weighted, atol):
    """Prefills, continuations, decode rows, an idle sequence; pages shuffled in the pool."""
    check_case(ic.mixed_case(page_size, seed=page_size), 4, 3, tail, weighted, atol)


def test_many_blocks_threshold_search(atol):
    """Block size 1: up to 43 candidate blocks per row (two tiles of 32) and k = 5 of them."""
    check_case(ic.mixed_case(4, seed=3), 1, 5, True, True, atol)


def test_k_larger_than_context(atol):
    case = ic.build_case([(ic.prompt(1, 30), 10, 20), (ic.prompt(2, 7), 6, 1)], 4)
    positions = check_case(case, 4, 50, True, False, atol)
    assert ic.as_sets(positions) == [list(range(p + 1)) for p in [*range(10, 30), 6]]


def test_selection_is_a_function_of_the_prefix():
    """One chunk, several chunks, a prefix-cache hit then decodes: the same positions per row,
    and the reference's."""
    per_split = split_rows(triton_select, 37, 4)
    assert all(rows == per_split[0] for rows in per_split[1:])
    assert per_split[0] == split_rows(select_positions_torch, 37, 4)[0]
    assert len(per_split) == len(SPLITS)


def test_ties_go_to_the_lower_block():
    cu, lens = torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([30, 30], dtype=torch.int32)
    q = torch.stack([torch.ones(2, 4), -torch.ones(2, 4)])
    positions = triton_select(
        q=q,
        weights=None,
        block_keys=torch.ones(2, 8, 4),
        cu_seqlens=cu,
        seq_lens=lens,
        block_size=4,
        top_blocks=2,
        tail=False,
    )
    assert ic.as_sets(positions) == [list(range(8)), list(range(8))]


def test_mla_views(atol):
    """Strided pools: the latent pool as k_pool, its first R channels as v_pool."""
    case = ic.mixed_case(4, seed=11)
    positions = select_positions_torch(**ic.select_args(case, 4, 3, True, True))
    latent = case["k_pool"].reshape(-1, 1, ic.HKV * ic.D)
    q = torch.randn(case["q"].shape[0], 3, ic.HKV * ic.D, generator=torch.Generator().manual_seed(0))
    args = dict(ic.attention_args(case, positions, SCALE), q=q, k_pool=latent, v_pool=latent[..., :10])
    torch.testing.assert_close(triton_attend(**args), sparse_attention_torch(**args), atol=atol, rtol=0)


def test_bf16_attention():
    case = ic.mixed_case(4, seed=5)
    positions = select_positions_torch(**ic.select_args(case, 4, 3, True, True))
    args = ic.attention_args(case, positions, SCALE)
    low = dict(args, **{n: args[n].bfloat16() for n in ("q", "k_pool", "v_pool")})
    out = triton_attend(**low)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), sparse_attention_torch(**low).float(), atol=3e-2, rtol=0)


def test_dispatch_to_triton():
    """Under the ``triton`` backend the public functions run the kernels (the interpreter on CPU)."""
    from kernels import backend
    from kernels.indexer import select_positions, sparse_attention
    from tests.kernels.triton_path.conftest import DEVICE

    case = ic.build_case([(ic.prompt(4, 19), 0, 12), (ic.prompt(5, 9), 8, 1)], 4)
    args = on_device(ic.select_args(case, 4, 2, True, True))
    with backend.use_backend("triton"):
        positions = select_positions(**args)
        out = sparse_attention(**on_device(ic.attention_args(case, positions.cpu(), SCALE)))
    assert positions.device.type == DEVICE.type
    assert torch.equal(positions.cpu(), select_positions_torch(**ic.select_args(case, 4, 2, True, True)))
    want = sparse_attention_torch(**ic.attention_args(case, positions.cpu(), SCALE))
    torch.testing.assert_close(out.cpu(), want, atol=1e-4, rtol=0)
