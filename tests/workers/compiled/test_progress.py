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
    shown = CompileProgress(4, "compiling the steps of m", "/cache")
    for label, key in (
        ("decode step, batch 1", "fxgraph_cache_hit"),
        ("decode step, batch 2", "fxgraph_cache_miss"),
        ("decode step, batch 4", "fxgraph_cache_bypass"),
        ("decode step, batch 8", None),
    ):
        with shown.graph(label):
            if key is not None:
                counters[key] += 1
    shown.finish()
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("[hybridserve compile] compiling the steps of m: 4 to warm up, cache /cache")
    assert err[1:3] == [
        "[hybridserve compile] 1/4 decode step, batch 1 ...",
        "[hybridserve compile] 1/4 decode step, batch 1: 0.0 s (from the cache)",
    ]
    assert err[4].endswith("2/4 decode step, batch 2: 0.0 s (compiled, now cached)")
    assert "3/4 decode step, batch 4: 0.0 s (compiled: the cache refuses" in err[6]
    assert err[8].endswith("4/4 decode step, batch 8: 0.0 s (an earlier graph serves it)")
    assert err[9].startswith("[hybridserve compile] ready in ") and err[9].endswith(
        "(4 of 4: 1 from the cache; 1 compiled, now cached; 1 compiled: the cache refuses frozen, "
        "packed graphs (pack_weights); 1 an earlier graph serves it)"
    )
    with pytest.raises(ValueError, match="call 5 .* of 4"):
        with shown.graph("one more"):
            pass
