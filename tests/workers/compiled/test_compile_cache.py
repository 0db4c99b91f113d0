"""The persistent compile cache: an engine started again over a warm ``compile.cache_dir``
loads every graph from it -- inductor's FX-graph and AOT-autograd caches hit, nothing misses
or is refused -- and says so on stderr, graph by graph. The warm engine is built from a
checkpoint of the same shapes but other weights than the one that filled the cache: the
cached graphs take the weights as inputs, so it must still give its own eager output, never
the first one's. A restart is modelled in-process: ``torch._dynamo.reset()`` drops every
compiled frame, so the second engine traces again and must find its graphs on disk.

Its two sizes share one graph, whose batch dims stay symbolic (``steps.mark_batch_dynamic``):
one graph to trace and to load. ``pack_weights`` (off by default) freezes packed weights into
the graphs, which both caches refuse (``workers/compiled/cache.py``): the suite's
``startup`` row counts the refusals."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from tests.workers.engine.helpers import make_llm, random_prompts
from tools.tiny import make_tiny_checkpoint
from workers.compiled.cache import cache_counters, compile_kwargs
from workers.sampling.params import SamplingParams

P = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_warm_restart_loads_every_graph(tmp_path, compile_cache_dir, capsys):
    first, second = (make_tiny_checkpoint("granitemoehybrid", tmp_path / f"m{seed}", seed=seed) for seed in (1, 2))
    settings = {"enabled": True, "batch_sizes": (2, 4), "cache_dir": str(compile_cache_dir)}
    graphs = counters["stats"]["unique_graphs"]
    make_llm(first, compile=settings)  # cold or warm: fills the cache
    assert counters["stats"]["unique_graphs"] - graphs == 1  # the two sizes share a graph (CPU)
    torch._dynamo.reset()
    before = cache_counters()
    capsys.readouterr()
    llm = make_llm(second, compile=settings)
    after, shown = cache_counters(), capsys.readouterr().err
    new = {key: after[key] - before[key] for key in after}
    assert new == {
        "fxgraph_cache_hit": 1,
        "fxgraph_cache_miss": 0,
        "fxgraph_cache_bypass": 0,
        "autograd_cache_hit": 1,
        "autograd_cache_miss": 0,
        "autograd_cache_bypass": 0,
    }, new
    assert "1/2 decode step, batch 2: " in shown and "(from the cache)" in shown, shown
    assert "2/2 decode step, batch 4: " in shown and "(an earlier graph serves it)" in shown, shown
    assert "(2 of 2: 1 from the cache; 1 an earlier graph serves it)" in shown, shown
    prompts = random_prompts(llm.engine.vocab_size, [6, 9, 7], seed=4)
    eager = {
        p: [o.token_ids for o in make_llm(p, compile={"enabled": False}).generate_ids(prompts, [P] * 3)]
        for p in (first, second)
    }
    assert eager[first] != eager[second]  # the weights do differ
    assert [o.token_ids for o in llm.generate_ids(prompts, [P] * 3)] == eager[second]
    assert llm.engine.runner.compiled.num_calls[(4, 1)] > 0  # three sequences, padded to four


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
    config = CompileConfig(enabled=True, batch_sizes=(1,))
    cpu, model = torch.device("cpu"), torch.nn.Identity()
    steps_mod.CompiledSteps(model, None, config, cpu, max_pages=4, page_size=16)
    steps_mod.CompiledSteps(model, None, config, cpu, max_pages=4, page_size=16, verify_lens=(4,))
    chain_mod.CompiledChain(model, model, None, config, cpu, num_drafts=3, page_size=16, max_model_len=64, max_pages=4)
    assert asked == [("steps", True), ("steps", False), ("chain", False)]


def test_the_cache_is_one_directory_per_native_build(tmp_path, monkeypatch):
    """A cached graph calls the native ops by the schema it was compiled against: a changed
    native source must not find the graphs built against the old one (it would crash)."""
    from kernels import native_ops
    from workers.compiled.cache import CACHE_ENV, configure_cache

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "restored after the test"))
    first = Path(configure_cache(str(tmp_path)))
    assert first.parent == tmp_path.resolve() and first.is_dir()
    assert configure_cache(str(tmp_path)) == str(first)  # the same build: the same directory
    sources = tmp_path / "sources"
    sources.mkdir()
    for name in (*native_ops.SOURCES, "native_common.h"):
        shutil.copy(native_ops.HERE / name, sources / name)
    (sources / "native_ops.cpp").write_text((sources / "native_ops.cpp").read_text() + "\n// another op\n")
    monkeypatch.setattr(native_ops, "HERE", sources)
    second = Path(configure_cache(str(tmp_path)))
    assert second.parent == tmp_path.resolve() and second != first
