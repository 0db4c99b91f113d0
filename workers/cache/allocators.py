"""Free lists for KV pages and Mamba slots: plain ints, no tensors.

Id 0 of each pool is a dummy write target (padding rows write there) and is never
handed out, so valid ids are ``1 .. size - 1``.
"""

from __future__ import annotations


class IdAllocator:
    """A free list over ids ``1 .. size - 1``.

    ``alloc(n)`` is all-or-nothing: it returns ``n`` ids or ``None`` and never partially
    allocates. ``free`` of an id that is already free raises (double free is a bug).
    """

    def __init__(self, size: int, name: str) -> None:
        if size < 2:
            raise ValueError(f"{name} pool needs at least 2 entries (1 dummy + 1 usable), got {size}")
        self.size = size
        self.name = name
        # Pop from the end; keep low ids first out so tests read naturally.
        self._free: list[int] = list(range(size - 1, 0, -1))
        self._is_free = [False] + [True] * (size - 1)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.size - 1

    def can_alloc(self, n: int) -> bool:
        return n <= len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        ids = [self._free.pop() for _ in range(n)]
        for i in ids:
            self._is_free[i] = False
        return ids

    def alloc_one(self) -> int | None:
        ids = self.alloc(1)
        return None if ids is None else ids[0]

    def free(self, ids: list[int]) -> None:
        for i in ids:
            assert 0 < i < self.size, f"{self.name}: id {i} out of range 1..{self.size - 1}"
            assert not self._is_free[i], f"{self.name}: double free of id {i}"
            self._is_free[i] = True
            self._free.append(i)

    def is_free(self, i: int) -> bool:
        return self._is_free[i]

    def usage_ratio(self) -> float:
        return 1.0 - len(self._free) / self.num_usable
