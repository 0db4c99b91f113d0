"""Which implementation an op runs: the one typed place for the kernel-backend switch.

Three settings (env ``HYBRIDSERVE_KERNEL_BACKEND``, read once at import; ``set_backend`` and
the ``use_backend`` context manager override it, e.g. in tests):

- ``auto`` (default): Triton for the recurrent ops and norms and FlashInfer for attention
  when the tensors are on CUDA; the torch reference otherwise (the CPU production path).
  FlashInfer takes fp16/bf16 attention only, and only with the ``gpu`` extra installed;
  otherwise attention stays on the torch path (with one warning when it is missing).
- ``torch``: the torch reference everywhere, also on CUDA (a GPU oracle for the kernels).
- ``triton``: Triton for the recurrent ops and norms wherever the tensors are. On CPU tensors
  this needs ``TRITON_INTERPRET=1`` set before the kernel modules are imported (the
  interpreter tests do that). Attention has no Triton kernel: it takes FlashInfer on CUDA,
  the torch path on CPU.

Ops ask through ``use_triton(t)`` / ``use_flashinfer(t)`` with one of their tensors. The
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
import warnings
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


def use_flashinfer(t: torch.Tensor) -> bool:
    """Should attention on tensor ``t`` (a query) run FlashInfer? Only on CUDA, never forced
    onto CPU; fp16/bf16 only (FlashInfer has no fp32 kernels); and only when the ``gpu``
    extra is installed (else the torch path, with one warning)."""
    if _backend is Backend.TORCH or not t.is_cuda:
        return False
    return t.dtype in (torch.float16, torch.bfloat16) and flashinfer_available()


@functools.cache
def flashinfer_available() -> bool:
    """Whether ``flashinfer`` can be found (looked up, not imported)."""
    if importlib.util.find_spec("flashinfer") is not None:
        return True
    warnings.warn("flashinfer is not installed (pip install -e '.[gpu]'): attention runs the "
                  "torch path on CUDA", RuntimeWarning, stacklevel=3)
    return False


def interpreting() -> bool:
    """True when Triton kernels run under the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def _require_interpreter() -> None:
    if not interpreting():
        raise RuntimeError(f"{ENV_VAR}=triton on CPU tensors needs TRITON_INTERPRET=1 in the "
                           "environment before the Triton kernel modules are imported")
