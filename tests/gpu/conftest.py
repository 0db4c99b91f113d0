"""GPU checks (files ``*_gpu.py``, marked ``gpu``): every kernel against its torch reference at
real sizes and dtypes, FlashInfer's plans, and whole-model greedy equality (the same checks
``tests/gpu/run_device_checks.sh`` reports as tables).

Skipped without CUDA, and when ``TRITON_INTERPRET`` is on (the CPU interpreter tests of
``tests/kernels/triton_path`` set it; run ``pytest tests/gpu`` in its own process). The other
files here run anywhere: the CPU dry run of the device-check script.
"""

from __future__ import annotations

import os

import pytest
import torch

from kernels.backend import interpreting

REASON = (
    "needs CUDA"
    if not torch.cuda.is_available()
    else "TRITON_INTERPRET is set: run tests/gpu in its own pytest process"
)
SKIP = not torch.cuda.is_available() or interpreting()


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    for item in items:
        path = str(item.fspath)
        if path.startswith(here) and path.endswith("_gpu.py"):
            item.add_marker(pytest.mark.gpu)
            if SKIP:
                item.add_marker(pytest.mark.skip(reason=REASON))


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)
    yield
