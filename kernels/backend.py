"""Which implementation an op runs: the one typed place for the kernel-backend switch.

Three settings (env ``HYBRIDSERVE_KERNEL_BACKEND``, read once at import; ``set_backend`` and
the ``use_backend`` context manager override it, e.g. in tests):

- ``auto`` (default): on CUDA tensors the Triton kernels, and for attention FlashInfer where
  it can run (``gpu`` extra installed, fp16/bf16, a head dim in ``FLASHINFER_HEAD_DIMS``),
  else the Triton paged-attention kernel (fp32, head dims such as 32 or 80, no FlashInfer);
  on CPU tensors the torch reference, and the C++ loops where an op has one
  (``use_native``: the GDN recurrence), which together are the CPU production path.
- ``torch``: the torch reference everywhere, also on CUDA (a GPU oracle for the kernels).
- ``triton``: Triton for every op, attention included (never FlashInfer), wherever the
  tensors are. On CPU tensors this needs ``TRITON_INTERPRET=1`` set before the kernel
  modules are imported (the interpreter tests do that).

Ops ask through ``use_triton(t)`` / ``attention_impl(q)`` with one of their tensors. The
kernel modules are imported lazily, on an op's first Triton / FlashInfer call: a CPU process
that never selects Triton never compiles or imports a kernel module of ours, and nothing
imports ``flashinfer`` off CUDA.
"""

from __future__ import annotations

import enum
import functools
import importlib.util
import os
import threading
from contextlib import contextmanager
from typing import Iterator

import torch

ENV_VAR = "HYBRIDSERVE_KERNEL_BACKEND"


class Backend(str, enum.Enum):
    AUTO = "auto"
    TORCH = "torch"
    TRITON = "triton"


def parse_backend(value: str | Backend) -> Backend:
    if isinstance(value, Backend):
        return value
    try:
        return Backend(value.strip().lower())
    except ValueError:
        names = ", ".join(b.value for b in Backend)
        raise ValueError(f"kernel backend must be one of {names}; got {value!r}") from None


_lock = threading.Lock()
_backend: Backend = parse_backend(os.environ.get(ENV_VAR, Backend.AUTO.value))


def get_backend() -> Backend:
    return _backend


def set_backend(value: str | Backend) -> Backend:
    """Set the process-wide backend; returns the previous one."""
    global _backend
    new = parse_backend(value)
    with _lock:
        old, _backend = _backend, new
    return old


@contextmanager
def use_backend(value: str | Backend) -> Iterator[Backend]:
    """``with use_backend("triton"): ...`` restores the previous setting on exit."""
    old = set_backend(value)
    try:
        yield parse_backend(value)
    finally:
        set_backend(old)


def use_native(t: torch.Tensor) -> bool:
    """Should a recurrent op on CPU tensor ``t`` run its C++ loop (``kernels/native_*.cpp``)
    rather than the torch reference? Under ``auto`` only: ``torch`` keeps the reference."""
    return _backend is Backend.AUTO and t.device.type == "cpu"


def use_triton(t: torch.Tensor) -> bool:
    """Should a recurrent op / norm on tensor ``t`` run its Triton kernel?"""
    backend = _backend
    if backend is Backend.TORCH:
        return False
    if backend is Backend.TRITON:
        if not t.is_cuda:
            _require_interpreter()
        return True
    return t.is_cuda


class AttentionImpl(str, enum.Enum):
    TORCH = "torch"
    TRITON = "triton"
    FLASHINFER = "flashinfer"


# Head dims FlashInfer's paged prefill and decode kernels are built for; others (the shipped
# tiny model's 32, 80, 96, ...) take the Triton kernel.
FLASHINFER_HEAD_DIMS = frozenset({64, 128, 256})


def attention_impl(q: torch.Tensor, windowed: bool = False) -> AttentionImpl:
    """Which paged attention runs on query ``q`` [T, Hq, D] (see the module docstring).

    FlashInfer only under ``auto``, on CUDA, fp16/bf16 (it has no fp32 kernels), a head dim
    it is built for, installed, no sliding window (``windowed``: our FlashInfer plans are
    built once per step for every layer, without ``window_left``), and not in a step dynamo
    traces (a compiled step: FlashInfer's wrappers plan on the host, which a graph cannot
    hold); every other CUDA case takes the Triton kernel.
    """
    backend = _backend
    if backend is Backend.TORCH:
        return AttentionImpl.TORCH
    if not q.is_cuda:
        if backend is Backend.TRITON:
            _require_interpreter()
            return AttentionImpl.TRITON
        return AttentionImpl.TORCH
    if (
        backend is Backend.AUTO
        and not windowed
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] in FLASHINFER_HEAD_DIMS
        and not torch.compiler.is_compiling()
        and flashinfer_available()
    ):
        return AttentionImpl.FLASHINFER
    return AttentionImpl.TRITON


@functools.cache
def flashinfer_available() -> bool:
    """Whether ``flashinfer`` can be found (looked up, not imported)."""
    return importlib.util.find_spec("flashinfer") is not None


def interpreting() -> bool:
    """True when Triton kernels run under the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def _require_interpreter() -> None:
    if not interpreting():
        raise RuntimeError(
            f"{ENV_VAR}=triton on CPU tensors needs TRITON_INTERPRET=1 in the "
            "environment before the Triton kernel modules are imported"
        )
