"""Two compiled engines in one process never share a graph. Module guards are skipped and,
with ``pack_weights``, a graph holds its engine's weights as constants: two checkpoints of
the same shapes but different weights, compiled one after the other, must each give their
own eager output (before ``compiled.cache.check_owner`` the second engine ran the first
one's graph, and so its weights). By default the second engine's graphs come from the
persistent cache the first one filled; with ``pack_weights`` (``slow``: no cache, a cold
compile each) they are frozen, packed and compiled anew."""

from __future__ import annotations

import pytest

from tests.workers.engine.helpers import make_llm, random_prompts
from tools.tiny import make_tiny_checkpoint
from workers.sampling.params import SamplingParams

P = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("pack_weights", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_engines_of_equal_shapes_keep_their_own_weights(tmp_path, compile_cache_dir, pack_weights):
    paths = [make_tiny_checkpoint("granitemoehybrid", tmp_path / f"m{seed}", seed=seed) for seed in (1, 2)]
    settings = {"enabled": True, "batch_sizes": (1,), "cache_dir": str(compile_cache_dir), "pack_weights": pack_weights}
    compiled = [make_llm(p, compile=settings) for p in paths]
    prompts = random_prompts(compiled[0].engine.vocab_size, [6], seed=3)
    eager = [[o.token_ids for o in make_llm(p, compile={"enabled": False}).generate_ids(prompts, [P])] for p in paths]
    assert eager[0] != eager[1]  # the weights do differ
    for llm, expected in zip([*compiled, compiled[0]], [*eager, eager[0]]):
        assert [o.token_ids for o in llm.generate_ids(prompts, [P])] == expected
        assert llm.engine.runner.compiled.num_calls[(1, 1)] > 0
