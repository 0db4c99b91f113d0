"""The decode fast path (``ForwardBatch.decode_only``) of both families: the same logits and
pools as the varlen path, taken whenever a step is all decodes, and invisible in the engine's
greedy output."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import replace
from typing import Iterator
from unittest import mock

import torch

import workers.models.gated_deltanet as gdn_layer
import workers.models.kda as kda_layer
import workers.models.layers as layers
import workers.models.lightning as lightning_layer
import workers.models.mamba1 as mamba1_layer
import workers.models.mamba1_heads as mamba1_heads_layer
import workers.models.mamba2 as mamba2_layer
import workers.models.rglru as rglru_layer
import workers.step_inputs as step_inputs
from kernels.recurrent_batch import Path, RecurrentBatch
from tests.workers.engine.helpers import GREEDY, greedy_tokens, make_llm
from tests.workers.models.harness import Harness, random_prompts

CONV = "causal_conv1d"
# The op each stateful layer calls, by the name its module calls it: the conv and every
# recurrent scan (one per slot layer); each follows its batch's ``RecurrentBatch.path``.
SCANS = [
    (gdn_layer, "gated_delta_rule"),
    (mamba2_layer, "ssd_scan"),
    (kda_layer, "kimi_delta_attention"),
    (lightning_layer, "lightning_attention"),
    (mamba1_layer, "mamba_selective_scan"),
    (mamba1_heads_layer, "mamba_selective_scan"),
    (rglru_layer, "rg_lru"),
]
OPS = [(layers, CONV), *SCANS]


@contextmanager
def count_calls(ops: list[tuple[object, str]] = OPS) -> Iterator[dict[tuple[object, str], mock.MagicMock]]:
    """Spies (the real op still runs) on the names the layers call the kernels by, keyed by
    (module, name): two layer modules may call one op."""
    with ExitStack() as stack:
        yield {
            (mod, name): stack.enter_context(mock.patch.object(mod, name, wraps=getattr(mod, name)))
            for mod, name in ops
        }


def paths(spies: dict[tuple[object, str], mock.MagicMock], path: Path, names: object = None) -> int:
    """Calls given a batch whose path is ``path`` (of the ops ``names``, or all)."""
    return sum(
        next(a for a in call.args if isinstance(a, RecurrentBatch)).path is path
        for (_, name), spy in spies.items()
        if names is None or name in names
        for call in spy.call_args_list
    )


def pool_tensors(harness: Harness) -> dict[str, torch.Tensor]:
    pools = harness.pools
    return {
        f"{pool}.{kind}.{name}": t
        for pool, groups in (("kv", pools.kv.groups), ("slot", pools.mamba.groups))
        for kind, tensors in groups.items()
        for name, t in tensors.items()
    }


def num_scan_layers(model) -> int:
    """Layers whose slot state has a scan state (``ssm``) beside, or without, a conv window
    (a short conv keeps only its window: no scan)."""
    return sum(g.num_layers for g in model.cache_spec().slot_groups if any(t.name == "ssm" for t in g.kind.tensors))


@torch.inference_mode()
def test_decode_only_equals_varlen_and_takes_the_update_ops(our_model) -> None:
    num_convs = sum(isinstance(m, layers.CausalConv1d) for m in our_model.modules())
    num_scans = num_scan_layers(our_model)
    harness = Harness(our_model)
    prompts = random_prompts(our_model.config.vocab_size, [5, 9, 2], seed=3)
    harness.prefill(prompts)
    tokens = [7, 8, 9]
    for step in range(3):
        batch = harness.make_batch([(i, [t]) for i, t in enumerate(tokens)])
        assert batch.decode_only
        before = [t.clone() for t in pool_tensors(harness).values()]
        with count_calls() as spies:
            ref = our_model(replace(batch, decode_only=False), harness.pools)
        assert paths(spies, Path.VARLEN) > 0 and paths(spies, Path.DECODE) == 0
        ref_pools = [t.clone() for t in pool_tensors(harness).values()]
        for t, saved in zip(pool_tensors(harness).values(), before):
            t.copy_(saved)
        with count_calls() as spies:
            got = our_model(batch, harness.pools)
        assert paths(spies, Path.VARLEN) == 0, f"step {step}: a varlen op ran"
        assert num_convs + num_scans > 0
        # each conv module once, a looped layer's (Inkling2-Loop) once per pass
        assert paths(spies, Path.DECODE, {CONV}) >= num_convs
        assert paths(spies, Path.DECODE, {name for _, name in SCANS}) == num_scans
        assert torch.equal(got, ref), f"step {step}"
        for (name, t), r in zip(pool_tensors(harness).items(), ref_pools):
            # unused slots hold NaN (the harness's poison): equal_nan, and nothing else moves
            torch.testing.assert_close(t, r, rtol=0, atol=0, equal_nan=True, msg=f"step {step}: {name} pool")
        tokens = our_model.compute_logits(got).argmax(-1).tolist()


def test_batches_with_prefill_or_no_state_keep_the_varlen_path(our_model) -> None:
    harness = Harness(our_model)
    first = harness.make_batch([(0, [5, 6, 7])])
    assert not first.decode_only  # a prefill chunk
    fresh = harness.make_batch([(0, [8]), (1, [9])])
    assert not fresh.decode_only  # sequence 1 has no state yet
    assert harness.make_batch([(0, [10]), (1, [11])]).decode_only


def test_engine_takes_the_fast_path_and_greedy_output_is_unchanged(tiny_model_dir) -> None:
    llm = make_llm(tiny_model_dir)
    prompts = random_prompts(llm.engine.vocab_size, [6, 13, 4], seed=5)
    with count_calls() as spies:
        fast_tokens = greedy_tokens(llm, prompts)
    # Every decode step (31 per request at most, some shared) ran the update ops.
    assert paths(spies, Path.DECODE) >= GREEDY.max_tokens - 1
    slow_llm = make_llm(tiny_model_dir)
    with (
        mock.patch.object(step_inputs, "is_decode_only", return_value=False),
        mock.patch("workers.model_runner.uniform_rows", return_value=0),
        count_calls() as spies,
    ):
        slow_tokens = greedy_tokens(slow_llm, prompts)
    assert paths(spies, Path.DECODE) == 0
    assert fast_tokens == slow_tokens


def test_speculative_verify_steps_take_the_verify_path_not_decode_only(tiny_qwen_dir) -> None:
    """A verify has k + 1 rows per sequence and per-row snapshots: never the decode fast path,
    but the verify fast path (``verify_len``); greedy tokens equal with it forced off."""
    llm = make_llm(tiny_qwen_dir, spec={"method": "mtp", "num_draft_tokens": 2})
    seen: list[tuple[int, bool, int]] = []
    real = llm.engine.runner._prepare

    def spy(plan, sampling=None):
        prepared = real(plan, sampling)
        seen.append((len(prepared.verify), prepared.fb.decode_only, prepared.fb.verify_len))
        return prepared

    prompts = random_prompts(llm.engine.vocab_size, [7], seed=6)
    with mock.patch.object(llm.engine.runner, "_prepare", spy):
        fast = greedy_tokens(llm, prompts)
    assert any(n > 0 for n, _, _ in seen)
    assert not any(flag for n, flag, _ in seen if n > 0)
    assert all(vlen == 3 for n, _, vlen in seen if n > 0)  # one sequence: every verify
    off = make_llm(tiny_qwen_dir, spec={"method": "mtp", "num_draft_tokens": 2})
    with (
        mock.patch("workers.step_inputs.uniform_snapshot_len", return_value=0),
        mock.patch("workers.model_runner.uniform_rows", return_value=0),
    ):
        assert greedy_tokens(off, prompts) == fast
