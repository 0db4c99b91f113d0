"""Every Triton kernel against its torch reference on CUDA, at real model sizes and dtypes:
the rows of stage (a) of the device checks (``tests/gpu/checks_kernels.py``) as tests."""

from __future__ import annotations

import pytest
import torch

from tests.gpu import checks_kernels

CHECKS = [
    (name, dtype, fn)
    for name, dtypes, fn in checks_kernels.checks(checks_kernels.FULL, torch.device("cuda"))
    for dtype in dtypes
]


@pytest.mark.parametrize("name,dtype,fn", CHECKS, ids=[f"{n}-{str(d).replace('torch.', '')}" for n, d, _ in CHECKS])
def test_kernel_matches_reference(name, dtype, fn):
    result, _ = fn(dtype)
    assert result.ok, f"{name} ({dtype}): max abs error {result.max_err:.3g}"
