"""The tiers benchmark's cluster (``cluster/bench/tiers.py``): replicas sized at
Qwen3-Next's proportions, their host tiers and the cluster store's model."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cluster.routing.routing_policy import RouterSettings
from cluster.store.client import FetchSettings

ROUTERS = ("hybrid_prefix", "ray_prefix", "round_robin")


@dataclass(frozen=True)
class ClusterSettings:
    num_replicas: int = 4
    kv_tokens: int = 24576  # device KV per replica
    slot_kv_tokens: int = 3072  # Qwen3-Next-80B: one slot (36 GDN layers) ~ 3,150 KV tokens
    host_factor: int = 2  # host tier per replica, in device budgets (see ``engine``)
    max_running: int = 3
    page_size: int = 16
    track_interval: int = 64
    chunk: int = 256
    store_factor: float = 4.0  # cluster store, in replica device budgets (see ``store_budget``)
    store_kv_tokens_per_s: float = 200_000.0  # a fetch's bandwidth, in KV tokens (modelled)
    prefill_tokens_per_s: float = 10_000.0  # a replica's prefill (modelled), for the cost model
    arrival_steps: float = 2.0  # overloaded: see ``below_capacity``
    think_steps: int = 6
    policy: str = "fcfs"  # scheduler.policy of every replica (fcfs | lpm)
    load_penalty_tokens: float = RouterSettings.load_penalty_tokens  # our router's load term (floor)
    load_penalty_auto: bool = RouterSettings.load_penalty_auto  # learnt (routing_policy.LoadPenalty)
    seed: int = 0

    def below_capacity(self) -> ClusterSettings:
        """The operating point for TTFT (BENCHMARKS.md, the tiers' TTFT goal): these settings
        with the session clock of a serving benchmark, below the cluster's capacity.

        The defaults overload the cluster (sessions every 2 steps, 6 steps between turns):
        TTFT there is the queue's length under any cache. ``think_steps`` 60: a tool call
        between turns (code, search) takes a second or more at a modelled step of these
        replicas (``tiers_ttft.StepCost``). ``arrival_steps`` 6: sessions start below the
        cluster's capacity, so most running slots are busy but the queue stays short.
        The router runs its defaults: its learnt load penalty (``routing_policy.LoadPenalty``,
        the prefill a routed request computes) spreads each tool set's sessions over the
        replicas, so TTFT is prefill, which the tiers cut, not one replica's queue."""
        return replace(self, think_steps=60, arrival_steps=6.0)

    @property
    def num_slots(self) -> int:
        return max(self.kv_tokens // self.slot_kv_tokens, self.max_running + 1)

    def engine(self, model: Path, tiers: bool) -> dict[str, Any]:
        """One replica's engine config. The host tier is ``host_factor`` device budgets,
        modelled on Qwen3-Next-80B on an 8 x H200 node (2 TB of DRAM, ~45 GB of cache per
        GPU after weights): 2 pins 2 x 45 GB x 8 = 0.72 TB, which leaves room beside Ray's
        object store (30 % of DRAM, at most 200 GB, where the cluster store lives) and the
        processes; 4 (1.44 TB) is the most such a node could pin, 8 (2.9 TB) does not fit.
        ``cluster_store_bytes`` only switches the engine's commits on here: the in-process
        store's budget is ``store_budget``."""
        cache = {
            "page_size": self.page_size,
            "max_kv_tokens": self.kv_tokens,
            "max_mamba_slots": self.num_slots,
            "mamba_track_interval": self.track_interval,
        }
        if tiers:
            cache.update(
                host_mamba_slots=self.host_factor * self.num_slots,
                host_kv_tokens=self.host_factor * self.kv_tokens,
                cluster_store_bytes=1 << 30 if self.store_factor > 0 else 0,
            )
        return {
            "model": str(model),
            "device": "cpu",
            "dtype": "float32",
            "seed": self.seed,
            "cache": cache,
            "scheduler": {
                "max_running_requests": self.max_running,
                "chunked_prefill_size": self.chunk,
                "max_batch_tokens": max(self.chunk, 512),
                "policy": self.policy,
            },
        }

    def store_model(self, token_bytes: int, slot_bytes: int) -> tuple[int, int, FetchSettings]:
        """The store at Qwen3-Next's proportions, from the tiny model's sizes (bytes of one KV
        token, of one slot): (budget bytes, bytes charged per entry on top of its payload,
        the fetch cost model's settings).

        The tiny model's slot weighs ~16 KV tokens, not ``slot_kv_tokens``, so its payloads
        would be all KV and a byte budget would hold ~8x the entries the modelled store
        does. Each entry is charged its slot at ``slot_kv_tokens`` KV tokens; the budget is
        ``store_factor`` replica device budgets (KV + slots at that weight: 4 = the
        cluster's device cache again, in the object store of its nodes). The cost model's
        throughputs are fixed (not measured from this CPU, so that fetch decisions are
        counts): ``store_kv_tokens_per_s`` (200k = 5 GB/s at Qwen3-Next's ~24 KiB of KV a
        token) and ``prefill_tokens_per_s``; a fetch then pays when it saves more than
        ~200 tokens of prefill (a ~75 MB Qwen3-Next checkpoint at 5 GB/s against 10k tokens/s)."""
        slot_extra = max(0, self.slot_kv_tokens * token_bytes - slot_bytes)
        device = self.kv_tokens * token_bytes + self.num_slots * (slot_bytes + slot_extra)
        fetch = FetchSettings(
            bandwidth_bytes_per_s=self.store_kv_tokens_per_s * token_bytes,
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            measure=False,
        )
        return int(self.store_factor * device), slot_extra, fetch
