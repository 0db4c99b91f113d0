"""C++ kernels for the ops compiled CPU steps call outside inductor's own code, and the CPU
loops of the recurrent ops.

A compiled CPU step (inductor with its C++ wrapper) runs without the GIL, except where it
calls an op inductor cannot generate: the in-place pool write ``hybridserve::scatter_rows``
(``kernels/static.py``) and, in batches where the static MoE is not the cheaper, the expert
loop ``hybridserve::moe_experts`` (``workers/models/moe_experts.py``). As Python ops each call
would take the GIL back, run the interpreter, and wait whenever another thread holds the GIL
(the scheduler thread under ``scheduler.overlap``, a replica's Ray and event-loop threads).

``load()`` builds the library ``hybridserve_native`` from ``SOURCES`` (each file compiled as
itself, all including ``native_common.h``) once per machine -- the build is cached under
torch's extension directory, ``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``, per
torch version, and ninja rebuilds what a changed source or header touches; concurrent
builders wait on the build's lock -- then loads it and registers the ops' fakes:
``native_ops.cpp`` defines the library (``scatter_rows``, ``moe_experts`` with the Python ops'
schemas; the expert loop's fused kernel for experts of few fp32 rows streams their weights
once, so eager and compiled steps compute the same bits); ``native_gdn.cpp`` the Gated
DeltaNet recurrence ``gdn_recurrent`` (``kernels/gdn/cpu.py``), ``native_conv.cpp`` the
causal conv1d ``causal_conv1d`` (``kernels/conv1d/cpu.py``), ``native_ssd.cpp`` Mamba2's
``ssd_recurrent`` (``kernels/ssd/cpu.py``): the CPU path of every batch of those ops, eager or
compiled; ``native_gemm.cpp`` the few-rows product ``few_rows_linear`` (``kernels/dense.py``:
every projection of 1-8 fp32 rows); ``native_fused.cpp`` the eager forward's fused elementwise
ops (``kernels/fused_cpu.py``, never traced). Compiled CPU steps trace with them when they
loaded; when they cannot be built (no compiler, no ninja) they trace with the Python ops, and
the reason is logged once.

``hold_refs(tensors)`` (``native_refs.cpp``'s ``TensorRefs``) holds one more C++ reference
to each tensor while the result lives: a compiled call's inputs held so are dropped by the
graph without taking the GIL (why, in the .cpp; ``workers/compiled/cache.py`` holds them).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from kernels import cpu_linear

logger = logging.getLogger(__name__)

NAME = "hybridserve_native"
HERE = Path(__file__).parent
# One library: native_ops.cpp defines it, each other file adds ops to it; all include
# native_common.h (ninja's dependency files rebuild what includes it when it changes).
SOURCES = (
    "native_ops.cpp",
    "native_gemm.cpp",
    "native_gdn.cpp",
    "native_conv.cpp",
    "native_ssd.cpp",
    "native_fused.cpp",
    "native_refs.cpp",
)


def build_flags() -> list[str]:
    """-O2 and native_ops.cpp's constants from ``kernels.cpu_linear`` (part of the build cache's key)."""
    return [
        "-O2",
        f"-DHS_MIN_ROWS={cpu_linear.MIN_ROWS}",
        f"-DHS_MIN_MACS={cpu_linear.MIN_MACS}",
        f"-DHS_PREFERS_ONEDNN={'true' if cpu_linear.prefers_onednn() else 'false'}",
    ]


_lock = threading.Lock()
_state: dict[str, object] = {}  # "loaded": bool, once load() ran; "error": str


def source_digest() -> str:
    """A digest of the native sources and build flags: what a compiled graph calling these ops
    was built against (a cached graph calling an op whose schema changed would crash)."""
    digest = hashlib.sha256(" ".join(build_flags()).encode())
    for name in (*SOURCES, "native_common.h"):
        digest.update((HERE / name).read_bytes())
    return digest.hexdigest()[:12]


def build_dir() -> Path:
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    path = Path(base) / f"{NAME}-torch{torch.__version__.replace('+', '_')}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def load() -> bool:
    """Build and load the native ops (at most once per process); True when they are usable."""
    with _lock:
        if "loaded" not in _state:
            _state["loaded"] = _build()
        return bool(_state["loaded"])


def loaded() -> bool:
    """Whether ``load()`` ran and the native ops are usable (what tracing reads)."""
    return bool(_state.get("loaded"))


def failure() -> str | None:
    """Why the native ops could not be built, if ``load()`` failed."""
    error = _state.get("error")
    return None if error is None else str(error)


POOL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # pools the native loops take


def usable(pool: torch.Tensor, *inputs: torch.Tensor | None) -> bool:
    """Whether a native loop over a state pool may run: CPU tensors, a pool dtype it takes with
    each slot contiguous, no autograd graph to record, and the ops built (``load()``, on the
    first call, once per process)."""
    tensors = [t for t in (pool, *inputs) if t is not None]
    if any(t.device.type != "cpu" for t in tensors) or pool.dtype not in POOL_DTYPES:
        return False
    if not pool[0].is_contiguous():
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return loaded() or load()


def hold_refs(tensors: Sequence[torch.Tensor]) -> object | None:
    """One more C++ reference to each of ``tensors`` for as long as the result lives (drop it
    with the GIL held: any Python code does); None when the native ops are not loaded."""
    refs = _state.get("refs")
    if refs is None:
        if not loaded():
            return None
        refs = _state["refs"] = torch.classes.hybridserve_native.TensorRefs  # looked up once: per call it costs a walk
    return refs(list(tensors))


def _build() -> bool:
    try:
        from torch.utils.cpp_extension import load

        load(
            NAME,
            sources=[str(HERE / name) for name in SOURCES],
            is_python_module=False,
            build_directory=str(build_dir()),
            extra_cflags=build_flags(),
            verbose=False,
        )
    except Exception as exc:  # no compiler / ninja / headers: the Python op stays
        _state["error"] = f"{type(exc).__name__}: {exc}"
        logger.warning(
            "compiled CPU steps keep the Python pool-write and expert-loop ops (each "
            "call takes the GIL): the native ops did not build: %s",
            _state["error"],
        )
        return False
    torch.library.register_fake(f"{NAME}::scatter_rows")(_scatter_rows_fake)
    torch.library.register_fake(f"{NAME}::moe_experts")(_moe_experts_fake)
    torch.library.register_fake(f"{NAME}::gdn_recurrent")(_gdn_recurrent_fake)
    torch.library.register_fake(f"{NAME}::causal_conv1d")(_causal_conv1d_fake)
    torch.library.register_fake(f"{NAME}::ssd_recurrent")(_ssd_recurrent_fake)
    torch.library.register_fake(f"{NAME}::few_rows_linear")(_few_rows_linear_fake)
    return True


def _scatter_rows_fake(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    return None


def _moe_experts_fake(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w_gate: torch.Tensor | None,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    act: str,
    limit: float = 0.0,
    invariant: bool = False,
) -> torch.Tensor:
    return x.new_empty(x.shape[0], w_down.shape[1])


def _few_rows_linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _gdn_recurrent_fake(
    states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slots: torch.Tensor,
    has_initial_state: torch.Tensor | None,
    dst: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> torch.Tensor:
    return v.new_empty(v.shape)  # v is [T, H, V]


def _causal_conv1d_fake(
    states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slots: torch.Tensor,
    has_initial_state: torch.Tensor | None,
    dst: torch.Tensor | None,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu: bool,
) -> torch.Tensor:
    return x.new_empty(x.shape)  # x is [T, D]


def _ssd_recurrent_fake(
    states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slots: torch.Tensor,
    has_initial_state: torch.Tensor | None,
    dst: torch.Tensor | None,
    x: torch.Tensor,
    dt: torch.Tensor,
    dt_bias: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    softplus: bool,
    dt_min: float,
    dt_max: float,
) -> torch.Tensor:
    return x.new_empty(x.shape)  # x is [T, H, P]
