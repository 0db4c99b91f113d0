"""The persistent input batch: a row per running request of what its steps read besides
the step itself -- its page table -- kept across steps and updated by diffs.

A request's row is written when it is first scheduled and then only when its pages change:
a page appended (a grown request: the new ids only), or its list replaced (admission, a
donation that swaps its prefix for the tree's copies, release), which ``Request.page_epoch``
counts. A step reads a snapshot of its rows (``table``), so the scheduler thread may edit
rows while a launched step runs. Rows return when the request finishes (``drop``); a
preempted request keeps its row, rewritten on readmission. Scheduler thread only.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from workers.request import Request


class InputBatch:
    def __init__(self, max_pages: int, num_rows: int = 64) -> None:
        self.max_pages = max_pages
        self.page_table = np.zeros((num_rows, max_pages), dtype=np.int32)
        self.num_pages = [0] * num_rows  # a list: read per row, and max() of a few is Python's
        # handle -> [row, page epoch, pages written]
        self._rows: dict[int, list[int]] = {}
        self._free = list(range(num_rows - 1, -1, -1))

    def rows(self, requests: Sequence[Request]) -> list[int]:
        """Each request's row, brought up to date with its pages."""
        out = []
        for req in requests:
            entry = self._rows.get(req.handle)
            if entry is None:
                entry = self._rows[req.handle] = [self._take_row(), -1, 0]
            pages = req.page_ids
            if entry[1] != req.page_epoch or entry[2] > len(pages):
                entry[1] = req.page_epoch
                self._write(entry, pages, 0)
            elif entry[2] < len(pages):
                self._write(entry, pages, entry[2])
            out.append(entry[0])
        return out

    def table(self, rows: Sequence[int]) -> np.ndarray:
        """A snapshot of ``rows``' page tables, as wide as the widest ([B, max pages])."""
        width = max(max((self.num_pages[r] for r in rows), default=1), 1)
        return self.page_table[rows, :width]

    def drop(self, handle: int) -> None:
        entry = self._rows.pop(handle, None)
        if entry is not None:
            self._free.append(entry[0])

    def _write(self, entry: list[int], pages: list[int], done: int) -> None:
        """Pages ``done:`` into the row (``done`` 0: a rewrite, clearing what it held past them)."""
        row, n = entry[0], len(pages)
        if n > self.max_pages:
            raise ValueError(f"{n} pages exceed the input batch's {self.max_pages} per request")
        self.page_table[row, done:n] = pages[done:]
        if done == 0:
            self.page_table[row, n : max(self.num_pages[row], n)] = 0
        entry[2] = n
        self.num_pages[row] = n

    def _take_row(self) -> int:
        if not self._free:
            n = len(self.num_pages)
            self.page_table = np.concatenate([self.page_table, np.zeros_like(self.page_table)])
            self.num_pages += [0] * n
            self._free = list(range(2 * n - 1, n - 1, -1))
        return self._free.pop()
