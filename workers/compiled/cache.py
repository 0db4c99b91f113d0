"""The persistent compile cache and the dynamo options compiled steps run under.

Inductor keeps its FX-graph cache (compiled kernels per graph) and the AOT-autograd cache
(the traced, functionalised graphs) under ``TORCHINDUCTOR_CACHE_DIR``; with both on, a
restart re-traces the step with dynamo (seconds) but compiles nothing again.
``configure_cache(dir)`` points that directory at ``compile.cache_dir`` (process-wide: the
directory is an environment variable inductor reads at each lookup) and turns both caches
on. ``cache_counters()`` reads inductor's hit / miss counters, the evidence that a warm
restart did not recompile.
"""
from __future__ import annotations

import os
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def configure_cache(cache_dir: str | None) -> str:
    """Use ``cache_dir`` (created if missing; None: inductor's default) for the persistent
    caches and turn them on; returns the directory in use."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    if cache_dir is not None:
        path = Path(cache_dir).expanduser().resolve()
        path.mkdir(parents=True, exist_ok=True)
        os.environ[CACHE_ENV] = str(path)
    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True
    from torch._inductor.runtime.cache_dir_utils import cache_dir as current
    return current()


def compile_kwargs(on_gpu: bool) -> dict[str, Any]:
    """``torch.compile`` arguments of a compiled step besides the function: CUDA graphs on a
    GPU; no guards on the modules (the served model and its MTP head never change once built,
    and checking their parameters costs more than a small step: ~0.5 ms a call on the CPU)."""
    options: dict[str, Any] = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    if on_gpu:
        options["triton.cudagraphs"] = True        # what mode="reduce-overhead" sets
    return {"options": options}


def compile_options(recompile_limit: int) -> AbstractContextManager:
    """Dynamo settings of a compiled step: shapes stay as marked (no automatic dynamic
    batch dim after a second bucket), and one graph per bucket fits the recompile limit."""
    return torch._dynamo.config.patch(automatic_dynamic_shapes=False,
                                      recompile_limit=recompile_limit)


def cache_counters() -> dict[str, int]:
    """Inductor's FX-graph cache and AOT-autograd cache hits / misses so far (process-wide)."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    aot = counters["aot_autograd"]
    return {"fxgraph_cache_hit": int(inductor["fxgraph_cache_hit"]),
            "fxgraph_cache_miss": int(inductor["fxgraph_cache_miss"]),
            "autograd_cache_hit": int(aot["autograd_cache_hit"]),
            "autograd_cache_miss": int(aot["autograd_cache_miss"])}
