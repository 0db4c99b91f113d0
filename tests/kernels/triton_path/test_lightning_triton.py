"""Lightning attention on the Triton path (SSD's kernels) against the torch path."""

from __future__ import annotations

import torch

import kernels.ssd
from kernels import backend
from kernels.lightning import lightning_attention
from tests.kernels.test_lightning import make_inputs
from tests.kernels.varlen_cases import assert_same_result, poison_no_init_slot


def _forbidden(*args, **kwargs):
    raise AssertionError("the torch reference ran on the Triton path")


def test_mixed_batch_with_snapshots(varlen_case, device, tol, max_abs_diff, monkeypatch):
    """Decode, short and chunked (> 16 tokens) sequences with snapshots, a NaN no-init slot."""
    case = varlen_case([0, 1, 4, 37, 1, 17], seed=3, snapshot_prob=0.2)
    inp = make_inputs(case.num_tokens, case.num_slots, seed=3)
    poison_no_init_slot(case, inp["states"])
    results = []
    for name, dev in (("torch", torch.device("cpu")), ("triton", device)):
        if name == "triton":
            monkeypatch.setattr(kernels.ssd, "ssd_torch", _forbidden)
        pool = inp["states"].clone().to(dev)
        with backend.use_backend(name):
            o = lightning_attention(*(inp[n].to(dev) for n in ("q", "k", "v", "slope")), pool, case.seqs(dev))
        results.append((o.cpu(), pool.cpu()))
    assert_same_result(results[1], results[0], tol, max_abs_diff)
