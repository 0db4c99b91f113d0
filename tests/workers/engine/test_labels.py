"""Depth labels are true by construction (I4) and the state oracle checks the data.

- Labels come from what the runner reports it wrote: a runner that writes another row than
  the plan asked for is reported as I4 and its checkpoint is never published.
- ``check_invariants`` compares every label (tree checkpoints, keep depths, live slots)
  with the ledger's content records.
- ``debug.state_oracle_sample`` recomputes published checkpoints by a fresh prefill: clean
  on a normal run, and it catches the aliasing bug when the guard is off
  (``test_spec.py::test_lazy_spec_overlap_guard_off_corrupts``).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import workers.model_runner as model_runner
from tests.workers.engine.helpers import make_llm, random_prompts
from tests.workers.engine.test_prefix_cache import shared_prefix_workload
from workers.sampling.params import SamplingParams
from workers.scheduler_types import StateWrite

P = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def lazy_llm(model_dir, overlap: bool = True, **debug):
    llm = make_llm(
        model_dir,
        cache={"mamba_strategy": "extra_buffer_lazy", "mamba_track_interval": 8, "max_mamba_slots": 24},
        scheduler={"overlap": overlap},
        debug={"check_invariants": True, **debug},
    )
    llm.engine.raise_on_violation = True
    return llm


@pytest.mark.parametrize("overlap", [False, True])
def test_state_oracle_clean(tiny_model_dir, overlap):
    llm = lazy_llm(tiny_model_dir, overlap, state_oracle_sample=1.0)
    prompts = shared_prefix_workload(llm.engine.vocab_size, num_systems=3, num_questions=4)
    for _ in range(2):
        llm.generate_ids(prompts, [P] * len(prompts))
    stats = llm.stats()
    assert stats["hybridserve_state_oracle_checks_total"] >= stats["hybridserve_mamba_donations_total"] > 0
    assert stats["hybridserve_state_oracle_mismatches_total"] == 0


def _shift_snapshots(prepared):
    """The runner bug to catch: every prefill snapshot taken one row early."""
    dst = prepared.fb.state_dst_slots
    if dst is None or prepared.verify:
        return prepared
    rows = dst.tolist()
    shifted = rows[1:] + [0]
    cu = prepared.fb.cu_seqlens.tolist()
    positions = prepared.fb.positions.tolist()
    writes = [w for w in prepared.writes if w.slot == prepared.live_slots[w.seq_index]]
    for b in range(len(cu) - 1):
        for t in range(cu[b], cu[b + 1]):
            if shifted[t]:
                writes.append(StateWrite(b, shifted[t], positions[t] + 1))
    fb = replace(prepared.fb, state_dst_slots=torch.tensor(shifted, dtype=torch.int32))
    return replace(prepared, fb=fb, writes=tuple(writes))


def test_runner_writing_another_row_is_reported_and_not_published(tiny_qwen_dir, monkeypatch):
    prompts = random_prompts(512, [13, 21, 30], seed=8)
    off = make_llm(tiny_qwen_dir, cache={"enable_prefix_cache": False})
    expected = [o.token_ids for o in off.generate_ids(prompts, [P] * 3)]
    real = model_runner.prepare_step
    monkeypatch.setattr(model_runner, "prepare_step", lambda *a, **k: _shift_snapshots(real(*a, **k)))
    llm = lazy_llm(tiny_qwen_dir)
    with pytest.raises(AssertionError, match="I4: batch .* the runner wrote"):
        llm.generate_ids(prompts, [P] * 3)
    llm = lazy_llm(tiny_qwen_dir, state_oracle_sample=1.0)
    llm.engine.raise_on_violation = False
    for _ in range(2):
        assert [o.token_ids for o in llm.generate_ids(prompts, [P] * 3)] == expected
    stats = llm.stats()
    assert stats["hybridserve_invariant_violations_total"].get("I4", 0) > 0
    assert stats["hybridserve_state_oracle_mismatches_total"] == 0  # nothing wrong was published


def test_check_invariants_compares_labels_with_contents(tiny_qwen_dir):
    llm = lazy_llm(tiny_qwen_dir)
    prompts = random_prompts(512, [13, 21], seed=9)
    llm.generate_ids(prompts, [P] * 2)
    engine = llm.engine
    assert engine.check_invariants() == []
    node = next(n for n in engine.cache.tree.iter_nodes() if n.checkpoint is not None)
    engine.slot_ledger.record_write(node.checkpoint.slot, node.depth + 1, batch_id=-1)
    found = engine.check_invariants()
    assert [v.invariant for v in found] == ["I4"], found
