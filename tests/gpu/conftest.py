"""GPU checks (``-m gpu``): every kernel against its torch reference at real sizes and dtypes,
FlashInfer against the torch attention, and whole-model greedy equality.

Skipped without CUDA, and when ``TRITON_INTERPRET`` is on (the CPU interpreter tests of
``tests/kernels/triton_path`` set it; run ``pytest tests/gpu`` in its own process, as
``tests/gpu/run_device_checks.sh`` does).
"""
from __future__ import annotations

import os

import pytest
import torch

from kernels.backend import interpreting

REASON = ("needs CUDA" if not torch.cuda.is_available() else
          "TRITON_INTERPRET is set: run tests/gpu in its own pytest process")
SKIP = not torch.cuda.is_available() or interpreting()


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if SKIP:
                item.add_marker(pytest.mark.skip(reason=REASON))


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)
    yield
