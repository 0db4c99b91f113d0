"""Shared fixtures: tiny random HF checkpoints, built once per test session."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory):
    from workers.models.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint("qwen3_next", tmp_path_factory.mktemp("qwen3_next"), seed=0, mtp=True)


@pytest.fixture(scope="session")
def tiny_granite_dir(tmp_path_factory):
    from workers.models.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint("granitemoehybrid", tmp_path_factory.mktemp("granite"), seed=0)


@pytest.fixture(scope="session", params=["qwen3_next", "granitemoehybrid"])
def tiny_model_dir(request, tiny_qwen_dir, tiny_granite_dir):
    return tiny_qwen_dir if request.param == "qwen3_next" else tiny_granite_dir


def pytest_configure(config):
    # Two shared cores: OpenMP spin-waits make tiny ops erratic when threads > 1.
    import torch

    torch.set_num_threads(1)
