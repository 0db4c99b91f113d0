"""A small memo keyed on the identity of batch-metadata tensors (host-side plans of kernels).

Kernels that need host copies of batch metadata (``cu_seqlens.tolist()`` and the like) pay a
device sync for them. Every layer of one forward step receives the same metadata tensor
objects, so a plan built by the first layer is reused by the others.

Contract: a batch-metadata tensor is not modified in place once a forward step has started
(the model runner builds fresh tensors per step). An entry is reused only while every key
tensor is the same live object (weak references, so a recycled address cannot alias) and,
outside inference mode, has the same ``_version`` (inference tensors keep no version counter).
While dynamo traces (a compiled step) nothing is memoised: the value is built in the graph.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Generic, Hashable, TypeVar

import torch
from torch import Tensor

T = TypeVar("T")


def _version(t: Tensor | None) -> int:
    if t is None:
        return -1
    try:
        return t._version
    except RuntimeError:  # inference tensors do not track versions
        return -2


class TensorMemo(Generic[T]):
    def __init__(self, size: int = 8) -> None:
        self.size = size
        self._entries: dict[Hashable, tuple[tuple[Any, ...], tuple[int, ...], T]] = {}

    def get(self, tensors: tuple[Tensor | None, ...], extra: Hashable, build: Callable[[], T]) -> T:
        """The value for ``tensors`` (by identity) and ``extra``; ``build()`` on a miss."""
        if torch.compiler.is_compiling():  # traced tensors have no identity to key on
            return build()
        key = (tuple(id(t) for t in tensors), extra)
        versions = tuple(_version(t) for t in tensors)
        hit = self._entries.get(key)
        if hit is not None:
            refs, old_versions, value = hit
            alive = all((r is None and t is None) or (r is not None and r() is t) for r, t in zip(refs, tensors))
            if alive and old_versions == versions:
                return value
        value = build()
        if key not in self._entries and len(self._entries) >= self.size:
            self._entries.pop(next(iter(self._entries)))
        self._entries[key] = (tuple(weakref.ref(t) if t is not None else None for t in tensors), versions, value)
        return value

    def clear(self) -> None:
        self._entries.clear()
