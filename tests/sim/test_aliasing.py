"""The keep-slot aliasing bug (see ``scenario.py``: a keep slot donated while an in-flight
verify writes it) in the deterministic
simulation: real scheduler, pools, tree, ledger, result processing and overlap lag over the
hash-chain toy model. See ``scenario.py`` for the workload.

Guard on (default): zero aliased donations, zero invariant violations, the guard visibly
acted (failed pending allocations, skipped donations), every prompt's grid checkpoint was
published, and every pass equals the cache-off control. Guard off
(``debug.disable_alias_guard``): the harness finds nodes whose slot holds the state of
another depth or prefix, and reusing them changes greedy outputs.
"""

from __future__ import annotations

import pytest

from tests.sim import scenario
from tests.sim.harness import Sim
from tests.sim.scenario import FULL_CHUNK64, FULL_PAGE64, FULL_PAGE64_CHUNK64, SGLANG, Scale

ALIASING = [SGLANG, FULL_PAGE64, FULL_CHUNK64]

_controls: dict[str, scenario.Passes] = {}


def control(model_dir, scale: Scale) -> scenario.Passes:
    """The same passes on a fresh engine with the prefix cache off (checked against the toy
    model's analytic greedy continuation, so the control itself is trustworthy)."""
    if scale.name not in _controls:
        with Sim(model_dir, scale.overrides(cache={"enable_prefix_cache": False})) as sim:
            passes = scenario.run(sim, scale, warm=False)
            for name, prompts in passes.passes.items():
                assert passes.tokens(name) == [sim.vocab.greedy(p, scale.max_tokens) for p in prompts], name
            assert sim.oracles.violations == {} and not sim.runner.corruptions
        _controls[scale.name] = passes
    return _controls[scale.name]


def assert_clean(sim: Sim) -> None:
    o = sim.oracles
    assert o.aliased == {}, list(o.aliased.values())[:5]
    assert o.violations == {}, sorted(o.violation_messages)[:5]
    assert sim.runner.corruptions == []
    assert o.keep_label_mismatches == [] and o.live_mismatches == []


@pytest.mark.parametrize("scale", ALIASING + [FULL_PAGE64_CHUNK64], ids=lambda s: s.name)
def test_guard_on(tiny_qwen_dir, scale):
    expected = control(tiny_qwen_dir, scale)
    with Sim(tiny_qwen_dir, scale.overrides()) as sim:
        passes = scenario.run(sim, scale)
        summary = sim.summary()
        assert_clean(sim)
        for name in passes.passes:
            assert passes.tokens(name) == expected.tokens(name), name
        # The pool was full of unlocked checkpoints: non-evicting pending allocations failed.
        assert summary["pending_alloc_failures"] >= scale.num_prompts, summary
        if scale in ALIASING:
            # ...and the guard refused the prefill donations the first verify was writing.
            skipped = summary["donations_skipped"].get("prefill_unfinished", 0)
            assert skipped >= scale.num_prompts // 4, summary
        # Every prompt's checkpoint at the grid crossing was eventually published, from the
        # verify's crossing row (the label repaired after a skipped donation).
        for p, out in zip(passes.prompts, passes.outputs["first"]):
            assert sim.inserted_at(p + out.token_ids[: scale.crossing - scale.prompt_len]), p[:3]
        # The second pass was served from the grid checkpoints (the follow-up turns).
        assert any(o.cached_tokens == scale.crossing for o in passes.outputs["second"])


@pytest.mark.parametrize("scale", ALIASING, ids=lambda s: s.name)
def test_guard_off_shows_the_bug(tiny_qwen_dir, scale):
    with Sim(tiny_qwen_dir, scale.overrides(debug={"disable_alias_guard": True})) as sim:
        warmup, passes = scenario.workload(scale, sim)
        sim.run(warmup, scenario.params(scale))
        first = sim.run(passes.prompts, scenario.params(scale))
        summary = sim.summary()
        aliases = list(sim.oracles.aliased.values())
        # Aliased donations: the prefill keep slot, donated at the prefill target, holds the
        # state the in-flight first verify wrote at the grid crossing (SGLang's signature).
        assert any(a.node_depth == scale.prefill_target and a.held_depth == scale.crossing for a in aliases)
        assert summary["aliased"] >= scale.num_prompts // 2, summary
        assert summary["violations"].get("I3", 0) > 0  # the ledger saw holders change
        assert summary["donations_skipped"] == {}
        assert [o.token_ids for o in first] == [sim.vocab.greedy(p, scale.max_tokens) for p in passes.prompts]
        # Reusing those checkpoints (the prompts again, at once) breaks greedy outputs.
        tree, aliased = sim.engine.cache.tree, {a.node_id for a in aliases}
        reused = [p for p in passes.prompts if tree.peek(p[:-1]).node.node_id in aliased]
        assert reused
        again = sim.run(reused, scenario.params(scale))
        assert sim.runner.corruptions
        assert [o.token_ids for o in again] != [sim.vocab.greedy(p, scale.max_tokens) for p in reused]


def test_extra_buffer_never_aliases(tiny_qwen_dir):
    """Non-lazy control: the second track slot is owned; nothing aliases and outputs are
    right. (It needs the guard too: a chained verify -- two verifies of a request in flight
    -- may write the keep slot in place while the verify before it publishes.)"""
    scale = SGLANG
    expected = control(tiny_qwen_dir, scale)
    # 3 slots per running request plus room for cached checkpoints.
    overrides = scale.overrides(cache={"mamba_strategy": "extra_buffer", "max_mamba_slots": 18})
    with Sim(tiny_qwen_dir, overrides) as sim:
        passes = scenario.run(sim, scale)
        assert_clean(sim)
        for name in passes.passes:
            assert passes.tokens(name) == expected.tokens(name), name
        assert sim.summary()["evicted"] > 0  # the pool was under pressure
        assert any(o.cached_tokens > 0 for o in passes.outputs["second"])
