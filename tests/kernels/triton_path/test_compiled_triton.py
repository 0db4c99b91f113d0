"""Compiled steps on the Triton path: what a compiled GPU step runs, here on the interpreter.

Dynamo cannot trace into our Triton launchers (launch plans memoised by tensor identity,
tile choices from shapes), so while it traces, each launcher is an opaque custom op
(``kernels/graph_ops.py``). Each family here compiles its decode (and, with MTP, verify and
draft-chain) steps with every op on the Triton path and must give the eager Triton path's
greedy tokens, the compiled steps having run. The graphs are compiled with the
``aot_eager`` backend: dynamo with ``fullgraph=True``, AOT functionalization of the in-place
pool writes and the ops' fakes -- the parts a GPU compile shares -- without inductor's
code generation (slow on two cores; the CPU steps' inductor path is tests/workers/compiled's).
"""

from __future__ import annotations

import pytest

from kernels import backend
from tests.kernels.triton_path.test_model_triton import KERNEL_FAMILIES, PROMPTS, TORCH_REFS, _forbidden
from tests.workers.engine.helpers import make_llm
from workers.compiled import draft_chain, steps
from workers.sampling.params import SamplingParams

P = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _tokens(llm) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(PROMPTS, P)]


@pytest.mark.core_families(families=KERNEL_FAMILIES)
def test_compiled_triton_steps_equal_eager(tiny_model_dir, tiny_model, monkeypatch):
    spec = {"method": "mtp", "num_draft_tokens": 2} if tiny_model.family.has_mtp else {"method": "none"}
    for module, name in TORCH_REFS:
        monkeypatch.setattr(module, name, _forbidden)
    with backend.use_backend("triton"):
        want = _tokens(make_llm(tiny_model_dir, spec=spec))
        for module in (steps, draft_chain):
            monkeypatch.setattr(module, "compile_kwargs", lambda *_, **__: {"backend": "aot_eager"})
        llm = make_llm(tiny_model_dir, spec=spec, compile={"enabled": True, "batch_sizes": (3,), "pack_weights": False})
        got = _tokens(llm)
    assert got == want
    assert sum(llm.engine.runner.compiled.num_calls.values()) > 0
