"""The persistent compile cache and the dynamo options compiled steps run under.

Inductor keeps its FX-graph cache (compiled kernels per graph) and the AOT-autograd cache
(the traced, functionalised graphs) under ``TORCHINDUCTOR_CACHE_DIR``. With both on, a
restart re-traces each graph with dynamo (seconds) and loads the rest from disk: nothing is
lowered or compiled again. The graphs take the weights as inputs, so one
cache entry serves every checkpoint of the same shapes and configuration.

Frozen graphs (``CallOptions(freeze=True)``, i.e. ``compile.pack_weights``) are refused by
both in torch 2.13: AOT-autograd's cache bypasses any graph compiled with ``freezing`` on
("Cannot cache a graph with freezing enabled"), and the FX-graph cache bypasses a graph
holding an mkldnn tensor ("mkldnn tensors unpickleable"), which is what packing makes of a
weight that stays an ATen GEMM (MKL's packed layout: at a decode step of at most 8 rows,
only the MoE routers' ``F.linear``, since the projections take the few-rows kernel). So
with ``pack_weights`` every start-up lowers every graph again. ``configure_cache(dir)``
points that directory at a subdirectory of ``compile.cache_dir`` per build of the native ops
(process-wide: the directory is an environment variable inductor reads at each lookup) and
turns both caches on.
``cache_counters()`` reads inductor's hit / miss / bypass counters, the evidence that a
warm restart did not recompile (or why it did).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import types
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch

from kernels import native_ops

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
_USER_CACHE_DIR = os.environ.get(CACHE_ENV)  # as the process started, before configure_cache sets it
# Graphs of one code object: one owner's buckets (compile_for_owner), with room to spare.
RECOMPILE_LIMIT = 256
SKIP_REFUSED = "skip_guard_eval_unsafe"  # in dynamo's error for a recompile under the skip
_T = TypeVar("_T")
logger = logging.getLogger(__name__)
_owners = itertools.count(1)


def new_owner() -> int:
    """A key unique to one compiled step's owner (an engine's ``CompiledSteps`` / chain) in
    this process; see ``check_owner``."""
    return next(_owners)


def check_owner(owner: int) -> None:
    """Called at the top of a traced step with its owner's key: dynamo then guards the graph
    on that key, so one engine never runs a graph another engine compiled (besides each
    owner's code object of its own, ``compile_for_owner``). (Module guards are
    skipped -- ``compile_kwargs`` -- and with ``pack_weights`` a graph holds its engine's
    weights as constants: two engines of equal shapes in one process would otherwise share
    a graph, and the second would run with the first one's weights.)"""
    if owner < 1:
        raise ValueError(f"compiled step owner key {owner} must be >= 1")


def configure_cache(cache_dir: str | None) -> str:
    """Use ``cache_dir`` (None: ``TORCHINDUCTOR_CACHE_DIR`` as the process started, else
    inductor's default) for the persistent caches and turn them on; returns the directory in
    use: a subdirectory per build of the native ops (``native_ops.source_digest``), since a
    cached graph calls them by the schema it was compiled against."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    base = cache_dir if cache_dir is not None else _USER_CACHE_DIR or default_cache_dir()
    path = Path(base).expanduser().resolve() / f"native-{native_ops.source_digest()}"
    path.mkdir(parents=True, exist_ok=True)
    os.environ[CACHE_ENV] = str(path)
    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True
    return str(path)


def compile_kwargs(on_gpu: bool, pack_weights: bool = False, gemm_templates: bool = True) -> dict[str, Any]:
    """``torch.compile`` arguments of a compiled step besides the function: CUDA graphs on a
    GPU; no guards on the modules (the served model and its MTP head never change once built,
    and checking their parameters costs more than a small step on the CPU);
    on CPU with ``pack_weights`` and ``gemm_templates``, inductor's CPU GEMM templates
    autotuned against ATen (they need frozen, prepacked weights: ``CallOptions(freeze=True)``).

    Speculation's verify steps and draft chain pass ``gemm_templates=False`` (ATen's packed
    GEMMs, still frozen): the autotuner times each GEMM alone, with its weight in cache, and
    at 1-4 rows picks templates that run slower inside the step, where every weight is read
    cold (BENCHMARKS.md, speculation's GEMMs). A projection of at most
    ``kernels.dense.FEW_ROWS`` rows calls the few-rows kernel in every step (an extern op:
    neither templates nor ATen's GEMM), so this choice concerns larger batches only."""
    options: dict[str, Any] = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    if on_gpu:
        options["triton.cudagraphs"] = True  # what mode="reduce-overhead" sets
    elif pack_weights and gemm_templates:
        options.update(
            max_autotune=True,
            max_autotune_gemm_backends="CPP,ATEN",
            autotune_num_choices_displayed=0,  # no per-GEMM tables on stderr
            max_autotune_report_choices_stats=False,
        )
    return {"options": options}


def compile_for_owner(method: Callable[..., Any], owner: int, **kwargs: Any) -> Callable[..., Any]:
    """``torch.compile(method, **kwargs)`` through a code object of the owner's own: dynamo
    keeps its graphs per code object, so one engine's graphs are never candidates for another
    engine's calls (``CallOptions``' guard skip relies on it), each engine's graphs count
    against their own recompile limit, and they are freed with the engine."""
    func = method.__func__  # type: ignore[attr-defined]
    code = func.__code__.replace(co_name=f"{func.__name__}_{owner}", co_qualname=f"{func.__qualname__}_{owner}")
    fresh = types.FunctionType(code, func.__globals__, code.co_name, func.__defaults__, func.__closure__)
    return torch.compile(types.MethodType(fresh, method.__self__), **kwargs)  # type: ignore[attr-defined]


class CallOptions:
    """The settings a compiled step runs under, built once per owner (``config.patch`` builds
    a class per call); ``call(fn, *args)`` runs one call under them. Dynamo's settings: shapes
    stay as marked (no automatic dynamic batch dim after a second bucket) and the owner's
    graphs fit the recompile limit. ``freeze``: inductor folds the parameters into the graph
    as constants (its ``freezing`` is read from the global config when a graph compiles, not
    from ``torch.compile``'s options, so it is patched around every call that may compile).
    ``cpp_wrapper`` (CPU steps): the graph's kernels are called from generated C++ instead of
    Python glue, which is cheaper per call.

    ``skip_guards`` (every call after ``warm_up``): dynamo checks only the guards that tell
    the owner's graphs apart -- its tensors' shapes, dtypes and strides, and any guard that
    ever failed -- not the rest (globals, module attributes, grad mode, aliasing). Safe
    because (invariant) a step's inputs are built by the owner's own code with fixed dtypes,
    its model and pools never change once built, and the owner's graphs live on a code
    object of its own (``compile_for_owner``). The stance is process-wide while a call runs
    (dynamo has no other scope): a replica process runs one engine.

    ``cpp_wrapper`` calls also hold their tensor arguments (``graph_inputs``: tensors and
    the tensor fields of dataclasses such as ``ForwardBatch``) by one more C++ reference
    (``native_ops.hold_refs``): the graph, which runs without the GIL, then drops them
    without taking it (``kernels/native_refs.cpp``). Otherwise each drop of an argument
    Python holds nothing else on takes the GIL and waits while another thread runs Python
    (in a serving replica: the scheduler thread, the event loop, Ray's threads)."""

    def __init__(self, freeze: bool = False, cpp_wrapper: bool = False) -> None:
        import torch._inductor.config as inductor_config

        patches = [torch._dynamo.config.patch(automatic_dynamic_shapes=False, recompile_limit=RECOMPILE_LIMIT)]
        if freeze:
            patches.append(inductor_config.patch(freezing=True))
        if cpp_wrapper:
            patches.append(inductor_config.patch(cpp_wrapper=True))
        self._patches = tuple(patches)
        self.hold_inputs = cpp_wrapper  # see the class docstring
        self.warm = False  # set by the owner's warm_up once every bucket is compiled
        self.num_recompiles = 0  # calls that needed a graph the warm-up did not compile

    @contextmanager
    def _options(self) -> Iterator[None]:
        with ExitStack() as stack:
            for patch in self._patches:
                stack.enter_context(patch)
            yield

    def call(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)``, skipping guards once ``warm``. A call that needs a new graph all the
        same (dynamo refuses to compile under the skip, before running anything) is logged
        and runs again with every guard, compiling it."""
        held = native_ops.hold_refs(graph_inputs(args)) if self.hold_inputs else None  # noqa: F841 (alive for the call)
        if not self.warm:
            with self._options():
                return fn(*args)
        try:
            # Warm: only the guard skip. The config patches shape compilation, and none happens
            # under the skip (a call that needs it is refused and runs below with them).
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                return fn(*args)
        except RuntimeError as e:
            if SKIP_REFUSED not in str(e):
                raise
        logger.warning("a compiled step needed a graph its warm-up did not compile; compiling it now")
        self.num_recompiles += 1
        with self._options():
            return fn(*args)


def graph_inputs(args: tuple[Any, ...]) -> list[torch.Tensor]:
    """The tensors among ``args`` and among the fields of the dataclasses in ``args``."""
    out: list[torch.Tensor] = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            out.append(arg)
        elif (names := _field_names(type(arg))) is not None:
            out += [v for v in (getattr(arg, n) for n in names) if isinstance(v, torch.Tensor)]
    return out


_FIELDS: dict[type, tuple[str, ...] | None] = {}


def _field_names(cls: type) -> tuple[str, ...] | None:
    """A dataclass's field names (None: not a dataclass), looked up once per class."""
    if cls not in _FIELDS:
        _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else None
    return _FIELDS[cls]


def cache_counters() -> dict[str, int]:
    """Inductor's FX-graph cache and AOT-autograd cache hits / misses / bypasses so far
    (process-wide; a bypass is a graph the cache refused, see the module docstring)."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    aot = counters["aot_autograd"]
    return {
        "fxgraph_cache_hit": int(inductor["fxgraph_cache_hit"]),
        "fxgraph_cache_miss": int(inductor["fxgraph_cache_miss"]),
        "fxgraph_cache_bypass": int(inductor["fxgraph_cache_bypass"]),
        "autograd_cache_hit": int(aot["autograd_cache_hit"]),
        "autograd_cache_miss": int(aot["autograd_cache_miss"]),
        "autograd_cache_bypass": int(aot["autograd_cache_bypass"]),
    }
