"""Find the host reads of a step on any device, the CPU included: what a CUDA graph cannot hold.

A CUDA graph replays device work only: a step that reads a device value on the host
(``.item()``, ``.tolist()``, ``bool(t)``, a data-dependent output size such as ``nonzero`` or
a boolean mask), or copies host data to the device (``torch.tensor(list)``), cannot be
captured. ``host_reads(fn)`` runs ``fn`` under a ``TorchFunctionMode`` that records every such
call with the first call site outside torch, so the check runs on the CPU before a GPU sees
the step. Calls made by Triton itself (its CPU interpreter moves every argument through the
host) are not the step's and are left out.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

READS = frozenset(
    {
        "item",
        "tolist",
        "__bool__",
        "__int__",
        "__float__",
        "__index__",
        "cpu",
        "numpy",
        "nonzero",
        "argwhere",
        "unique",
        "unique_consecutive",
        "masked_select",
        "bincount",
        "tensor",
        "as_tensor",
        "from_numpy",
    }
)
INDEXING = frozenset({"__getitem__", "__setitem__", "index_put_", "index_put"})


def _is_read(name: str, args: tuple, kwargs: dict) -> bool:
    if name in READS:
        return True
    if name == "repeat_interleave":  # tensor repeats: the output size is data
        return any(isinstance(a, torch.Tensor) for a in list(args[1:]) + list(kwargs.values()))
    if name in INDEXING:  # a boolean mask index: a nonzero inside
        index = args[1] if len(args) > 1 else None
        parts = index if isinstance(index, (tuple, list)) else (index,)
        return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)
    return False


def _call_site() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if "/triton/" in path:
            return ""  # Triton's own (interpreter) traffic
        if "/torch/" not in path:
            return f"{path.rsplit('/', 2)[-2]}/{path.rsplit('/', 1)[-1]}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class _Recorder(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if _is_read(name, args, kwargs):
            site = _call_site()
            if site:
                self.reads.append(f"{name} at {site}")
        return func(*args, **kwargs)


def host_reads(fn: Callable[[], Any]) -> list[str]:
    """The host reads ``fn()`` makes, as ``"name at folder/file.py:line"``, in call order."""
    recorder = _Recorder()
    with recorder:
        fn()
    return recorder.reads
