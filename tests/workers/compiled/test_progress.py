"""What a compiling start-up shows on stderr: a line as each graph begins and ends (i of N,
its seconds, where it came from by inductor's cache counters) and a total."""
from __future__ import annotations

import pytest

from workers.compiled import progress as progress_mod
from workers.compiled.progress import CompileProgress

ZERO = {f"{cache}_cache_{what}": 0 for cache in ("fxgraph", "autograd") for what in ("hit", "miss", "bypass")}


def test_each_graph_says_where_it_came_from(monkeypatch, capsys):
    counters = dict(ZERO)
    monkeypatch.setattr(progress_mod, "cache_counters", lambda: dict(counters))
    shown = CompileProgress(3, "compiling the steps of m", "/cache")
    for label, key in (("decode step, batch 1", "fxgraph_cache_hit"), ("decode step, batch 2", "fxgraph_cache_miss"),
                       ("decode step, batch 4", "fxgraph_cache_bypass")):
        with shown.graph(label):
            counters[key] += 1
    shown.finish()
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("[hybridserve compile] compiling the steps of m: 3 graphs, cache /cache")
    assert err[1:3] == ["[hybridserve compile] 1/3 decode step, batch 1 ...",
                        "[hybridserve compile] 1/3 decode step, batch 1: 0.0 s (from the cache)"]
    assert err[4].endswith("2/3 decode step, batch 2: 0.0 s (compiled, now cached)")
    assert "3/3 decode step, batch 4: 0.0 s (compiled: the cache refuses" in err[6]
    assert err[7].startswith("[hybridserve compile] ready in ") and err[7].endswith(
        "(3 of 3: 1 from the cache; 1 compiled, now cached; 1 compiled: the cache refuses frozen, packed graphs "
        "(pack_weights))")
    with pytest.raises(ValueError, match="graph 4 .* of 3"):
        with shown.graph("one more"):
            pass
