"""Per-architecture fixtures: our model and the transformers oracle on the same checkpoint."""

from __future__ import annotations

import pytest
import torch

from tests.workers.models.hf_oracle import HFOracle
from workers.loader import load_model
from workers.models.base import HybridForCausalLM


@pytest.fixture(scope="module")
def our_model(tiny_model_dir) -> HybridForCausalLM:
    return load_model(tiny_model_dir, torch.float32, "cpu").model


@pytest.fixture(scope="module")
def hf_oracle(tiny_model_dir) -> HFOracle:
    return HFOracle(tiny_model_dir)
