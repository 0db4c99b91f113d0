"""The persistent compile cache: an engine started again over a warm ``compile.cache_dir``
compiles nothing (inductor's FX-graph cache hits, no miss), and still gives the eager
engine's greedy output. A restart is modelled in-process: ``torch._dynamo.reset()`` drops
every compiled frame, so the second engine traces again and must find its graphs on disk.

With ``pack_weights`` (the CPU default) inductor freezes the weights into each graph, and
both caches refuse frozen graphs with packed weights (``workers/compiled/cache.py`` says
why): a warm restart lowers the graphs again but finds its compiled C++ and GEMM autotuning
choices on disk (the suite's ``startup_warm_s`` measures it and counts the refusals), so the
no-recompile contract is tested with ``pack_weights`` off."""
from __future__ import annotations

import torch

from tests.workers.engine.helpers import make_llm, random_prompts
from workers.compiled.cache import cache_counters, compile_kwargs
from workers.sampling_params import SamplingParams

P = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_warm_restart_compiles_nothing(tiny_granite_dir, compile_cache_dir):
    settings = {"enabled": True, "batch_sizes": (2,), "cache_dir": str(compile_cache_dir), "pack_weights": False}
    make_llm(tiny_granite_dir, compile=settings)             # cold or warm: fills the cache
    torch._dynamo.reset()
    before = cache_counters()
    llm = make_llm(tiny_granite_dir, compile=settings)
    after = cache_counters()
    assert after["fxgraph_cache_miss"] == before["fxgraph_cache_miss"], (before, after)
    assert after["fxgraph_cache_hit"] > before["fxgraph_cache_hit"], (before, after)
    prompts = random_prompts(llm.engine.vocab_size, [6, 9], seed=4)
    eager = make_llm(tiny_granite_dir)
    assert ([o.token_ids for o in llm.generate_ids(prompts, [P] * 2)]
            == [o.token_ids for o in eager.generate_ids(prompts, [P] * 2)])
    assert llm.engine.runner.compiled.num_calls[(2, 1)] > 0


def test_speculation_steps_compile_with_aten_gemms():
    """Decode steps autotune inductor's CPU GEMM templates; verify steps and the draft chain
    do not (``compile_kwargs``: the templates chosen alone ran slower inside them)."""
    decode = compile_kwargs(on_gpu=False, pack_weights=True)["options"]
    spec = compile_kwargs(on_gpu=False, pack_weights=True, gemm_templates=False)["options"]
    assert decode.get("max_autotune") and "CPP" in decode["max_autotune_gemm_backends"]
    assert not spec.get("max_autotune") and "max_autotune_gemm_backends" not in spec


def test_verify_steps_and_chain_ask_for_aten_gemms(monkeypatch):
    """The wiring: decode steps ask for the templates, verify steps and the chain do not
    (their constructors compile nothing: ``torch.compile`` is lazy)."""
    import workers.compiled.draft_chain as chain_mod
    import workers.compiled.steps as steps_mod
    from configs.schema import CompileConfig

    asked: list[tuple[str, bool]] = []

    def spy(module: str):
        def record(on_gpu: bool, pack_weights: bool = False, gemm_templates: bool = True):
            asked.append((module, gemm_templates))
            return compile_kwargs(on_gpu, pack_weights, gemm_templates)
        return record
    monkeypatch.setattr(steps_mod, "compile_kwargs", spy("steps"))
    monkeypatch.setattr(chain_mod, "compile_kwargs", spy("chain"))
    config, cpu, model = CompileConfig(enabled=True, batch_sizes=(1,)), torch.device("cpu"), torch.nn.Identity()
    steps_mod.CompiledSteps(model, None, config, cpu, max_pages=4, page_size=16)
    steps_mod.CompiledSteps(model, None, config, cpu, max_pages=4, page_size=16, verify_lens=(4,))
    chain_mod.CompiledChain(model, model, None, config, cpu, num_drafts=3, page_size=16, max_model_len=64,
                            max_pages=4)
    assert asked == [("steps", True), ("steps", False), ("chain", False)]
