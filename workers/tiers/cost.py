"""Fetch or recompute? The cost model of a cluster-store fetch (pure; no clocks, no I/O).

A replica whose local tiers match a prompt to depth ``local`` while the store holds a
checkpoint at ``depth`` may fetch it (``bytes`` over the wire, then a host -> device copy)
or recompute the ``depth - local`` tokens by prefill. Both sides are seconds:

    fetch_s     = latency_s + bytes / bandwidth_bytes_per_s
    recompute_s = (depth - local) / prefill_tokens_per_s

and the fetch is chosen when it is cheaper by at least ``margin`` (a fraction of the
recompute time: estimates are noisy, and a fetch that only ties is pure risk).
Throughputs come measured (``Throughput``: an exponential average of observations,
starting from a configured prior) or configured.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FetchCost:
    bytes_to_move: int
    tokens_to_recompute: int
    bandwidth_bytes_per_s: float
    prefill_tokens_per_s: float
    latency_s: float = 0.0
    margin: float = 0.1

    def __post_init__(self) -> None:
        if self.bandwidth_bytes_per_s <= 0 or self.prefill_tokens_per_s <= 0:
            raise ValueError(
                f"throughputs must be > 0: bandwidth {self.bandwidth_bytes_per_s} B/s, "
                f"prefill {self.prefill_tokens_per_s} tokens/s"
            )
        if self.bytes_to_move < 0 or self.latency_s < 0 or not 0 <= self.margin < 1:
            raise ValueError(
                f"bytes {self.bytes_to_move}, latency {self.latency_s} s, margin {self.margin} "
                "out of range (>= 0, >= 0, [0, 1))"
            )

    @property
    def fetch_s(self) -> float:
        return self.latency_s + self.bytes_to_move / self.bandwidth_bytes_per_s

    @property
    def recompute_s(self) -> float:
        return max(self.tokens_to_recompute, 0) / self.prefill_tokens_per_s

    @property
    def should_fetch(self) -> bool:
        return self.tokens_to_recompute > 0 and self.fetch_s < (1.0 - self.margin) * self.recompute_s


class Throughput:
    """An exponentially weighted average of a rate, starting from a prior."""

    def __init__(self, prior: float, weight: float = 0.2) -> None:
        if prior <= 0 or not 0 < weight <= 1:
            raise ValueError(f"prior {prior} must be > 0 and weight {weight} in (0, 1]")
        self.value = prior
        self.weight = weight
        self.num_observations = 0

    def observe(self, amount: float, seconds: float) -> None:
        """``amount`` units (bytes, tokens) took ``seconds``; ignored when either is <= 0."""
        if amount <= 0 or seconds <= 0:
            return
        self.value += self.weight * (amount / seconds - self.value)
        self.num_observations += 1
