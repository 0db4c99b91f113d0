"""What a start-up that compiles shows its user: a line per bucket on stderr.

A cold compile of every bucket takes minutes on a CPU and a warm one seconds; either way the
user of ``hybridserve serve`` (a replica's stderr reaches the driver's terminal under Ray)
or of the offline ``LLM`` sees which bucket is being built, i of N, its seconds and whether
its graph was compiled, loaded from the persistent cache or shared with an earlier bucket.
Plain lines rather than a redrawn bar: a replica's stderr is a pipe, where a carriage
return would only pile up.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import NamedTuple

from workers.compiled.cache import cache_counters

PREFIX = "[hybridserve compile]"


class CompileTimes(NamedTuple):
    wall_s: float
    cpu_s: float  # this process's CPU time, not its compilers': a warm start's wall time on a free core


class CompileProgress:
    """Counts the warm-up calls of one engine's start-up (``total``, known before the first:
    one per bucket and kind of step) and writes a line to stderr as each begins and ends
    (the graph it compiled, loaded or shared), a header first and a total last."""

    def __init__(self, total: int, what: str, cache_dir: str) -> None:
        if total < 1:
            raise ValueError(f"a compile progress needs at least one warm-up call, got total={total}")
        self.total, self.done = total, 0
        self._start, self._start_cpu = time.monotonic(), time.process_time()
        self._sources: Counter[str] = Counter()  # where each graph came from (``_source``)
        _write(
            f"{what}: {total} to warm up, cache {cache_dir} (a cold cache takes minutes on a CPU, a "
            "warm one seconds; compile.enabled: false starts eager)"
        )

    @contextmanager
    def graph(self, label: str) -> Iterator[None]:
        """Times the warm-up call inside the block (``label``: e.g. "decode step, batch 4")."""
        self.done += 1
        if self.done > self.total:
            raise ValueError(f"compile progress: warm-up call {self.done} ({label}) of {self.total}")
        _write(f"{self.done}/{self.total} {label} ...")
        before, t0 = cache_counters(), time.monotonic()
        yield
        source = _source(before, cache_counters())
        self._sources[source] += 1
        _write(f"{self.done}/{self.total} {label}: {time.monotonic() - t0:.1f} s ({source})")

    def finish(self) -> CompileTimes:
        """Writes the total line; returns the seconds since the header."""
        took = CompileTimes(time.monotonic() - self._start, time.process_time() - self._start_cpu)
        sources = "; ".join(f"{n} {source}" for source, n in self._sources.most_common())
        _write(f"ready in {took.wall_s:.1f} s, {took.cpu_s:.1f} s of CPU ({self.done} of {self.total}: {sources})")
        return took


def timed(progress: CompileProgress | None, label: str) -> AbstractContextManager[None]:
    """``progress.graph(label)``, or nothing to show when there is no progress."""
    return progress.graph(label) if progress is not None else nullcontext()


def _source(before: dict[str, int], after: dict[str, int]) -> str:
    """Where a graph came from, by inductor's cache counters over its build."""
    new = {key: after[key] - before[key] for key in after}
    if new["fxgraph_cache_bypass"]:
        return "compiled: the cache refuses frozen, packed graphs (pack_weights)"
    if new["fxgraph_cache_miss"]:
        return "compiled, now cached"
    if new["fxgraph_cache_hit"]:
        return "from the cache"
    return "an earlier graph serves it"


def _write(line: str) -> None:
    print(f"{PREFIX} {line}", file=sys.stderr, flush=True)
