"""``RecurrentBatch``: its path rule, the step's instance on ``ForwardBatch``, and each op's
torch backend running the form the path allows."""

from __future__ import annotations

from dataclasses import replace
from unittest import mock

import pytest
import torch

import kernels.conv1d.reference as conv_ref
import kernels.gdn.reference as gdn_ref
import kernels.kda.reference as kda_ref
import kernels.selective_scan.reference as scan_ref
import kernels.ssd.reference as ssd_ref
from kernels import backend
from kernels.conv1d import causal_conv1d
from kernels.gdn import gated_delta_rule
from kernels.kda import kimi_delta_attention
from kernels.recurrent_batch import Path, RecurrentBatch
from kernels.selective_scan import mamba_selective_scan
from kernels.ssd import ssd_scan
from workers.forward_batch import ForwardBatch

I32 = torch.int32
NUM_SEQS, SEQ_LEN = 2, 3


def batch(uniform_len: int, snapshots: bool) -> RecurrentBatch:
    """Two sequences of ``uniform_len`` tokens (3 when 0) on slots 1, 2; snapshots in 3.."""
    rows = uniform_len or SEQ_LEN
    dst = torch.arange(3, 3 + NUM_SEQS * rows, dtype=I32) if snapshots else None
    return RecurrentBatch(
        torch.arange(0, NUM_SEQS * rows + 1, rows, dtype=I32),
        torch.tensor([1, 2], dtype=I32),
        torch.ones(NUM_SEQS, dtype=torch.bool),
        dst,
        uniform_len,
    )


def test_the_path_rule():
    assert batch(1, snapshots=False).path is Path.DECODE
    assert batch(1, snapshots=True).path is Path.VERIFY  # a decode with a snapshot each
    assert batch(3, snapshots=True).path is Path.VERIFY
    assert batch(0, snapshots=True).path is Path.VARLEN
    assert batch(0, snapshots=False).path is Path.VARLEN
    assert batch(3, snapshots=False).path is Path.VARLEN  # no form of its own
    assert batch(3, snapshots=True).initial_flags is None  # every sequence has a state
    assert batch(0, snapshots=True).initial_flags is not None


def test_decode_layout_is_memoised_on_the_slots():
    slots = torch.tensor([4, 2], dtype=I32)
    seqs = RecurrentBatch.decode(slots)
    assert seqs.path is Path.DECODE and seqs.slot_ids is slots
    assert seqs.cu_seqlens.tolist() == [0, 1, 2] and seqs.has_initial_state.all()
    assert RecurrentBatch.decode(slots) is seqs


def _forward_batch(decode_only: bool, verify_len: int) -> ForwardBatch:
    i64 = torch.zeros(NUM_SEQS * SEQ_LEN, dtype=torch.int64)
    return ForwardBatch(
        i64,
        i64,
        torch.tensor([0, 3, 6], dtype=I32),
        torch.tensor([3, 3], dtype=I32),
        i64,
        torch.zeros(NUM_SEQS, 1, dtype=I32),
        torch.tensor([1, 2], dtype=I32),
        torch.ones(NUM_SEQS, dtype=torch.bool),
        i64,
        4,
        state_dst_slots=torch.arange(3, 9, dtype=I32),
        decode_only=decode_only,
        verify_len=verify_len,
    )


def test_forward_batch_builds_the_step_metadata_once():
    fb = _forward_batch(decode_only=False, verify_len=SEQ_LEN)
    seqs = fb.recurrent
    assert seqs is fb.recurrent
    assert seqs.path is Path.VERIFY and seqs.uniform_len == SEQ_LEN
    assert seqs.cu_seqlens is fb.cu_seqlens and seqs.slot_ids is fb.mamba_slot_ids
    assert seqs.state_dst_slots is fb.state_dst_slots
    assert replace(fb, verify_len=0).recurrent.path is Path.VARLEN  # derived anew
    decode = replace(fb, decode_only=True, verify_len=0).recurrent
    assert decode.path is Path.DECODE and decode.state_dst_slots is None


def _delta_rule_inputs(num_tokens: int, per_channel_decay: bool) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(num_tokens, 2, 4, generator=gen) for _ in range(3))
    g = -torch.rand(num_tokens, 2, 4, generator=gen) if per_channel_decay else -torch.rand(num_tokens, 2, generator=gen)
    return q, k, v, g, torch.rand(num_tokens, 2, generator=gen), torch.randn(9, 2, 4, 4, generator=gen)


def _scan_inputs(num_tokens: int, mamba1: bool) -> tuple[torch.Tensor | None, ...]:
    gen = torch.Generator().manual_seed(1)
    if mamba1:
        x, dt = torch.randn(num_tokens, 4, generator=gen), torch.randn(num_tokens, 4, generator=gen)
        b, c = torch.randn(num_tokens, 3, generator=gen), torch.randn(num_tokens, 3, generator=gen)
        return x, dt, -torch.rand(4, 3, generator=gen), b, c, None, None, torch.randn(9, 4, 3, generator=gen)
    x, dt = torch.randn(num_tokens, 2, 4, generator=gen), torch.randn(num_tokens, 2, generator=gen)
    b, c = torch.randn(num_tokens, 1, 3, generator=gen), torch.randn(num_tokens, 1, 3, generator=gen)
    return (
        x,
        dt,
        -torch.rand(2, generator=gen),
        b,
        c,
        torch.ones(2),
        torch.zeros(2),
        torch.randn(9, 2, 4, 3, generator=gen),
    )


def _call(op: str, seqs: RecurrentBatch) -> torch.Tensor:
    num_tokens = int(seqs.cu_seqlens[-1])
    if op == "gdn":
        return gated_delta_rule(*_delta_rule_inputs(num_tokens, False), seqs)
    if op == "kda":
        return kimi_delta_attention(*_delta_rule_inputs(num_tokens, True), seqs)
    if op == "ssd":
        return ssd_scan(*_scan_inputs(num_tokens, False), seqs)
    if op == "selective_scan":
        return mamba_selective_scan(*_scan_inputs(num_tokens, True), seqs)
    x, weight = torch.randn(num_tokens, 4), torch.randn(4, 3)
    return causal_conv1d(x, weight, None, torch.randn(9, 4, 2), seqs)


# op -> (reference module, its decode form, its verify form (None: the varlen one), its varlen form)
FORMS = {
    "gdn": (gdn_ref, "gated_delta_rule_update_torch", "gated_delta_rule_verify_torch", "gated_delta_rule_varlen_torch"),
    "kda": (kda_ref, "kda_update_torch", "kda_verify_torch", "kda_varlen_torch"),
    "ssd": (ssd_ref, "ssd_update_torch", "ssd_verify_torch", "ssd_varlen_torch"),
    "selective_scan": (scan_ref, "selective_scan_update_torch", None, "selective_scan_varlen_torch"),
    "conv1d": (conv_ref, "causal_conv1d_update_torch", "causal_conv1d_verify_torch", "causal_conv1d_varlen_torch"),
}


@pytest.mark.parametrize("op", sorted(FORMS))
@pytest.mark.parametrize("seqs, form", [(batch(1, False), 1), (batch(SEQ_LEN, True), 2), (batch(0, True), 3)])
def test_the_torch_backend_runs_the_form_of_the_path(op, seqs, form):
    module, *names = FORMS[op]
    want = names[form - 1] or names[2]
    spies = {name: mock.patch.object(module, name, wraps=getattr(module, name)) for name in set(names) - {None}}
    started = {name: patcher.start() for name, patcher in spies.items()}
    try:
        with backend.use_backend("torch"), torch.inference_mode():
            _call(op, seqs)
    finally:
        for patcher in spies.values():
            patcher.stop()
    assert {name: spy.call_count for name, spy in started.items()} == {n: int(n == want) for n in started}
