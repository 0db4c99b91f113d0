"""Compiled calls skip dynamo's guard evaluation once warm (``CallOptions``), which is safe
only because every owner's graphs live on a code object of their own
(``compile_for_owner``): two owners of the same method never see each other's graphs. A
warm call that needs a new graph all the same is refused by dynamo under the skip and runs
again with every guard (compiling it) instead of failing the step."""

from __future__ import annotations

import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from workers.compiled.cache import CallOptions, compile_for_owner, new_owner


class Scale(torch.nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def step(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def test_owners_keep_their_graphs_apart_under_the_guard_skip(caplog):
    torch._dynamo.reset()
    mods = [Scale(2.0), Scale(3.0)]
    compiled = [compile_for_owner(m.step, new_owner(), backend="eager", fullgraph=True) for m in mods]
    calls = [CallOptions(), CallOptions()]
    x = torch.ones(3)
    for fn, m, call in zip(compiled, mods, calls):
        assert torch.equal(call.call(fn, x), x * m.factor)
        call.warm = True
    codes = [fn._torchdynamo_orig_callable.__code__ for fn in compiled]
    assert codes[0] is not codes[1]
    assert [len(_debug_get_cache_entry_list(c)) for c in codes] == [1, 1]
    for fn, m, call in zip(compiled, mods, calls):  # warm: guards skipped, each its own graph
        assert torch.equal(call.call(fn, x), x * m.factor)
    assert not _refusals(caplog)
    for fn, m, call in zip(compiled, mods, calls):  # a new shape: refused, then compiled
        assert torch.equal(call.call(fn, torch.ones(2, 2)), torch.ones(2, 2) * m.factor)
    assert [len(_debug_get_cache_entry_list(c)) for c in codes] == [2, 2]
    assert _refusals(caplog) == 2
    assert [call.num_recompiles for call in calls] == [1, 1]  # what the engine's counter reads


def _refusals(caplog) -> int:
    return sum(r.name == "workers.compiled.cache" and "did not compile" in r.getMessage() for r in caplog.records)
