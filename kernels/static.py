"""Helpers for shape-static steps: the ones ``torch.compile`` traces or a CUDA graph captures.

Two things differ when a step is traced or captured instead of run eagerly:

- ``tracing()`` is True (dynamo is tracing it, the current CUDA stream is capturing, or a
  ``static_formulation()`` block asks for it eagerly: tests, and checks of a step's host reads):
  an op must then take its static formulation, with no host read (``.tolist()``, a
  data-dependent output size) -- e.g. the MoE's dense / gathered expert path
  (``workers/models/moe.py``) instead of its per-expert loop.
- ``scatter_rows_(dst, index, src)`` writes rows of a state pool in place. Eagerly it is
  ``dst[index] = src``; under dynamo it is the custom op ``hybridserve::scatter_rows``, which
  declares that it mutates ``dst``. Without it, AOT functionalization turns an index write
  into a pool view (``pool[layer][slots] = state``) into an out-of-place ``index_put`` on the
  whole pool tensor plus a copy back: every step would copy every pool (tens of MB).
  On CPU, once ``kernels.native_ops.load()`` succeeded, the op traced is its C++ twin
  ``hybridserve_native::scatter_rows`` (no GIL, no interpreter inside a compiled step).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from kernels import native_ops

_forced = threading.local()


@torch.library.custom_op("hybridserve::scatter_rows", mutates_args=("dst",))
def _scatter_rows(dst: Tensor, index: Tensor, src: Tensor) -> None:
    dst.index_copy_(0, index, src)


@_scatter_rows.register_fake
def _scatter_rows_fake(dst: Tensor, index: Tensor, src: Tensor) -> None:
    return None


def tracing() -> bool:
    """True while torch.compile traces the step, a CUDA stream captures it, or inside
    ``static_formulation()`` (this thread)."""
    if torch.compiler.is_compiling():
        return True
    if getattr(_forced, "on", False):
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@contextmanager
def static_formulation() -> Iterator[None]:
    """Run ops eagerly in their traced formulation (what a compiled step runs), on this thread."""
    was = getattr(_forced, "on", False)
    _forced.on = True
    try:
        yield
    finally:
        _forced.on = was


def scatter_rows_(dst: Tensor, index: Tensor, src: Tensor) -> None:
    """``dst[index] = src`` in place (rows of dim 0; ``src`` cast to ``dst.dtype``).

    ``index`` must not repeat a row unless every write to it is garbage (slot 0 / page 0,
    the padding rows' dummy targets): which write wins is unspecified.
    """
    index = index.long()
    src = src.to(dst.dtype)
    if torch.compiler.is_compiling():
        rows = src.reshape(index.shape[0], *dst.shape[1:])
        if dst.device.type == "cpu" and native_ops.loaded():
            torch.ops.hybridserve_native.scatter_rows(dst, index, rows)
        else:
            _scatter_rows(dst, index, rows)
    else:
        dst[index] = src
