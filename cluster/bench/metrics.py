"""Serving metrics from per-request client timings, with vLLM's definitions (pure functions).

The definitions (``vllm bench serve``, ``vllm/benchmarks/serve.py``), per successful request:
- TTFT: send -> the first streamed chunk carrying content (text or token ids); an empty
  chunk (a chat ``role`` delta, a usage-only chunk) is not a token.
- ITL: the gaps between consecutive content chunks, pooled over all requests. A chunk
  holding several tokens (speculative decoding, coalescing) is ONE gap: compare TPOT, not
  ITL, across spec on/off.
- E2EL: send -> end of the response stream.
- TPOT: (E2EL - TTFT) / (output_tokens - 1), over requests with more than one output
  token. For goodput a one-token request counts as TPOT 0 (vLLM's rule).
- Throughputs: completed requests, output tokens and input + output tokens, each over
  the benchmark's wall duration. Failed requests count only toward ``failed``.
- Goodput: requests per second that completed AND met every SLO given
  (``{"ttft": ms, "tpot": ms, "e2el": ms}``; a metric <= its SLO is met), DistServe's
  definition as vLLM implements it.
- Percentiles: numpy's default (linear interpolation between closest ranks).

Added here (not vLLM's): ``cached_fraction`` (prompt tokens the server reported as
cached ÷ prompt tokens, from ``usage.prompt_tokens_details.cached_tokens``), ``max_concurrency``
(the most requests in flight at once) and SGLang's ``concurrency`` (sum of E2EL ÷ wall).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

SLO_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True)
class RequestRecord:
    """What the client saw of one request. Times in seconds, ``start`` on any clock."""

    success: bool
    start: float = 0.0  # when the request was sent
    ttft: float = 0.0  # first content chunk - start
    e2el: float = 0.0  # end of stream - start
    itl: tuple[float, ...] = ()  # gaps between content chunks (len = chunks - 1)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """(E2EL - TTFT) / (out - 1); None for a request with at most one output token."""
        if not self.success or self.output_tokens <= 1:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Summary:
    """mean / median / std / requested percentiles of one latency metric, in ms."""

    mean: float
    median: float
    std: float
    percentiles: dict[str, float] = field(default_factory=dict)  # "p99" -> ms


@dataclass(frozen=True)
class BenchMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    cached_tokens: int
    request_throughput: float  # req/s
    output_throughput: float  # output tok/s
    total_token_throughput: float  # (input + output) tok/s
    request_goodput: float | None  # good req/s; None when no SLO was given
    cached_fraction: float
    max_concurrency: int
    concurrency: float
    ttft_ms: Summary
    tpot_ms: Summary
    itl_ms: Summary
    e2el_ms: Summary
    slos_ms: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(values: Sequence[float], q: float) -> float:
    """numpy.percentile(values, q) with its default linear method; 0.0 for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values_s: Sequence[float], percentiles: Sequence[float] = (99,)) -> Summary:
    """Seconds in, ms out. Empty input gives zeros (vLLM's ``np.mean(x or 0)``)."""
    if not values_s:
        return Summary(0.0, 0.0, 0.0, {_pname(p): 0.0 for p in percentiles})
    n = len(values_s)
    mean = sum(values_s) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values_s) / n)  # population, like np.std
    return Summary(
        1000 * mean,
        1000 * percentile(values_s, 50),
        1000 * std,
        {_pname(p): 1000 * percentile(values_s, p) for p in percentiles},
    )


def _pname(p: float) -> str:
    return f"p{p:g}"


def is_good(record: RequestRecord, slos_ms: Mapping[str, float]) -> bool:
    """Completed and within every SLO given (TPOT of a one-token request counts as 0)."""
    if not record.success:
        return False
    got = {"ttft": record.ttft, "tpot": record.tpot or 0.0, "e2el": record.e2el}
    return all(got[name] <= slo / 1000.0 for name, slo in slos_ms.items())


def max_in_flight(records: Sequence[RequestRecord]) -> int:
    """The most requests in flight at once (all requests, failed ones included)."""
    edges = sorted(
        [(r.start, 1) for r in records] + [(r.start + r.e2el, -1) for r in records], key=lambda e: (e[0], e[1])
    )  # ends before starts at equal times
    peak = cur = 0
    for _, step in edges:
        cur += step
        peak = max(peak, cur)
    return peak


def compute_metrics(
    records: Sequence[RequestRecord],
    duration_s: float,
    slos_ms: Mapping[str, float] | None = None,
    percentiles: Sequence[float] = (99,),
) -> BenchMetrics:
    if duration_s <= 0:
        raise ValueError(f"duration_s must be positive, got {duration_s}")
    slos = dict(slos_ms or {})
    unknown = set(slos) - set(SLO_METRICS)
    if unknown:
        raise ValueError(f"unknown SLO metrics {sorted(unknown)}; use {SLO_METRICS}")
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    tpots = [t for r in ok if (t := r.tpot) is not None]
    itls = [gap for r in ok for gap in r.itl]
    goodput = sum(is_good(r, slos) for r in ok) / duration_s if slos else None
    return BenchMetrics(
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        cached_tokens=cached,
        request_throughput=len(ok) / duration_s,
        output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        request_goodput=goodput,
        cached_fraction=cached / total_in if total_in else 0.0,
        max_concurrency=max_in_flight(records),
        concurrency=sum(r.e2el for r in ok) / duration_s,
        ttft_ms=summarize([r.ttft for r in ok], percentiles),
        tpot_ms=summarize(tpots, percentiles),
        itl_ms=summarize(itls, percentiles),
        e2el_ms=summarize([r.e2el for r in ok], percentiles),
        slos_ms=slos,
    )


def parse_slos(items: Sequence[str]) -> dict[str, float]:
    """``["ttft:2000", "tpot:250"]`` (vLLM's ``--goodput``) -> {"ttft": 2000.0, ...} in ms."""
    out: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"goodput SLO must be one of {SLO_METRICS} as NAME:MS, got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"goodput SLO {item!r}: {value!r} is not a number of ms") from None
        if ms <= 0:
            raise ValueError(f"goodput SLO {item!r} must be positive")
        out[name] = ms
    return out


def format_report(m: BenchMetrics, title: str = "Serving Benchmark Result") -> str:
    """A plain-text block in the shape of vLLM's report."""
    lines = [f"{'=' * 16} {title} {'=' * 16}"]

    def row(label: str, value: Any, fmt: str = "{:<10.2f}") -> None:
        lines.append(f"{label:<39} " + (fmt.format(value) if not isinstance(value, str) else value))

    row("Successful requests:", m.completed, "{:<10}")
    row("Failed requests:", m.failed, "{:<10}")
    row("Maximum request concurrency:", m.max_concurrency, "{:<10}")
    row("Benchmark duration (s):", m.duration_s)
    row("Total input tokens:", m.total_input_tokens, "{:<10}")
    row("Total generated tokens:", m.total_output_tokens, "{:<10}")
    row("Cached prompt fraction:", m.cached_fraction, "{:<10.3f}")
    row("Request throughput (req/s):", m.request_throughput)
    if m.request_goodput is not None:
        slos = " ".join(f"{k}:{v:g}" for k, v in m.slos_ms.items())
        row(f"Request goodput (req/s) [{slos}]:", m.request_goodput)
    row("Output token throughput (tok/s):", m.output_throughput)
    row("Total token throughput (tok/s):", m.total_token_throughput)
    for name, label in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"),
        ("e2el", "End-to-end Latency"),
    ):
        s: Summary = getattr(m, f"{name}_ms")
        lines.append(f"{'-' * 15}{label}{'-' * 15}")
        row(f"Mean {name.upper()} (ms):", s.mean)
        row(f"Median {name.upper()} (ms):", s.median)
        for p, v in s.percentiles.items():
            row(f"{p.upper()} {name.upper()} (ms):", v)
    lines.append("=" * (34 + len(title)))
    return "\n".join(lines)
