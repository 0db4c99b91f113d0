"""The suite's configuration (``configs/workloads/suite.yaml``) and its goals."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cluster.bench.workloads import WORKLOAD_DIR

SUITE_YAML = WORKLOAD_DIR / "suite.yaml"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EfficiencyCfg(_Strict):
    batch: int = Field(8, ge=1)
    prompt_len: int = Field(32, ge=1)
    output_len: int = Field(64, ge=3)


class TransformersCfg(_Strict):
    num_prompts: int = Field(16, ge=1)
    min_prompt_len: int = Field(32, ge=1)
    max_prompt_len: int = Field(512, ge=1)
    output_len: int = Field(32, ge=1)


class PrefixCacheCfg(_Strict):
    workload: str = "shared_prefix"
    overrides: dict[str, Any] = Field(default_factory=dict)
    max_concurrency: int = Field(1, ge=1)
    chunks: int = Field(4, ge=1)  # cache on / off alternate chunk by chunk
    floor_prompt_len: int = Field(16, ge=1)  # TTFT of a prompt this short: the fixed cost


class RoutingCfg(_Strict):
    num_replicas: int = Field(4, ge=2)
    workload: str = "cache_pressure"
    overrides: dict[str, Any] = Field(default_factory=dict)
    rate: float = Field(5.0, gt=0)
    max_concurrency: int = Field(8, ge=1)
    model: str = "configs/models/tiny-hybrid"
    engine: dict[str, Any] = Field(default_factory=dict)


class SpecCfg(_Strict):
    repeats: int | None = Field(None, ge=1)  # None: the suite's repeats
    output_len: int = Field(48, ge=3)
    sweep: list[int] = Field(default_factory=list)
    prompts: list[str] = Field(min_length=1)


class OverlapCfg(_Strict):
    repeats: int | None = Field(None, ge=1)  # None: the suite's repeats
    batch: int = Field(16, ge=1)
    prompt_len: int = Field(64, ge=1)
    output_len: int = Field(32, ge=1)


class CompileCfg(_Strict):
    """``compile.*`` of every suite engine; each section compiles one bucket, its own batch."""

    enabled: bool = True
    cache_dir: str | None = None  # None: inductor's default (persists across runs)


class EosWorkloadCfg(_Strict):
    """Continuous batching's case on a ~100M Qwen3-Next with real head dims: outputs of
    sampled lengths, each request stopping at its own (as at EOS)."""

    num_prompts: int = Field(24, ge=1)
    batch: int = Field(8, ge=1)  # engine concurrency = HF batch size
    min_prompt_len: int = Field(32, ge=1)
    max_prompt_len: int = Field(256, ge=1)
    min_output_len: int = Field(4, ge=1)
    max_output_len: int = Field(128, ge=1)
    repeats: int | None = Field(1, ge=1)  # None: the suite's repeats


class StartupCfg(_Strict):
    batch_sizes: list[int] = Field(default_factory=lambda: [1, 2, 4, 8])


class SimulationCfg(_Strict):
    replicas: list[int] = Field(default_factory=lambda: [8, 16, 32])
    workloads: list[str] = Field(default_factory=lambda: ["cache_pressure", "multi_turn"])


class TiersCfg(_Strict):
    """bench/tiers.py: slot_pressure over in-process replicas, and the multi-turn case."""

    num_replicas: int = Field(4, ge=1)
    num_sessions: int = Field(32, ge=1)
    num_turns: int = Field(4, ge=1)
    host_factor: int = Field(2, ge=1)  # host tier per replica, in device budgets (ClusterSettings.engine)
    routers: list[str] = Field(default_factory=lambda: ["hybrid_prefix", "ray_prefix"])


class HostOverheadCfg(_Strict):
    """bench/host_overhead.py: the engine's host CPU per request-step on a near-null model."""

    batches: list[int] = Field(default_factory=lambda: [1, 8, 32, 128, 256, 512])
    modes: list[str] = Field(default_factory=lambda: ["default", "mtp"])
    steps: int = Field(30, ge=1)
    warmup: int = Field(5, ge=0)
    min_request_steps: int = Field(512, ge=1)


class SuiteConfig(_Strict):
    repeats: int = Field(3, ge=1)
    bench_model: str | None = None
    spec_model: str = "configs/models/qwen3-next-tiny-py"
    spec_fallback_model: str = "configs/models/tiny-hybrid"
    serving_efficiency: EfficiencyCfg = EfficiencyCfg()
    vs_transformers: TransformersCfg = TransformersCfg()
    prefix_cache: PrefixCacheCfg = PrefixCacheCfg()
    routing: RoutingCfg = RoutingCfg()
    spec: SpecCfg
    overlap: OverlapCfg = OverlapCfg()
    simulation: SimulationCfg = SimulationCfg()
    tiers: TiersCfg = TiersCfg()
    compile: CompileCfg = CompileCfg()
    eos_workload: EosWorkloadCfg = EosWorkloadCfg()
    startup: StartupCfg = StartupCfg()
    host_overhead: HostOverheadCfg = HostOverheadCfg()
    sections: list[str] = Field(default_factory=lambda: list(SECTIONS))


SECTIONS = (
    "overlap",
    "spec",
    "vs_transformers",
    "eos_workload",
    "startup",
    "host_overhead",
    "serving",
    "routing",
    "simulation",
    "tiers",
)


def load_suite_config(path: Path | None = None, overrides: dict[str, Any] | None = None) -> SuiteConfig:
    data = _merge(yaml.safe_load((path or SUITE_YAML).read_text()) or {}, overrides or {})
    try:
        cfg = SuiteConfig.model_validate(data)
    except ValidationError as exc:
        errs = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"invalid suite config: {errs}") from None
    unknown = set(cfg.sections) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown suite sections {sorted(unknown)}; use {SECTIONS}")
    return cfg


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


class Goal(NamedTuple):
    op: str  # ">=", "<=", or "report" (a figure without a goal)
    bound: float
    what: str

    def met(self, value: float | None) -> bool | None:
        if value is None or self.op == "report":
            return None
        return value >= self.bound if self.op == ">=" else value <= self.bound

    def text(self) -> str:
        if self.op == "report":
            return "(reported)"
        return f"{'≥' if self.op == '>=' else '≤'} {self.bound:g}"


GOALS: dict[str, Goal] = {
    "serving_efficiency": Goal(">=", 0.85, "HTTP decode tok/s ÷ bare forward loop, same model and batch"),
    "vs_transformers_speedup": Goal(">=", 3.0, "run-batch throughput ÷ transformers generate, mixed prompts"),
    "prefix_cache_prefill_fraction": Goal("<=", 0.2, "prompt tokens computed ÷ prompt tokens, shared prefix"),
    "prefix_cache_ttft_ratio": Goal("<=", 0.35, "mean TTFT cache on ÷ off, shared prefix"),
    "routing_hit_ratio_vs_round_robin": Goal(">=", 2.0, "cached-token fraction hybrid_prefix ÷ round_robin"),
    "routing_hit_ratio_vs_ray": Goal(">=", 1.15, "cached-token fraction hybrid_prefix ÷ Ray PrefixCacheAffinityRouter"),
    "routing_load_max_min": Goal("<=", 1.5, "requests per replica max ÷ min, hybrid_prefix"),
    "spec_tpot_speedup": Goal(">=", 1.4, "TPOT spec off ÷ on, batch 1"),
    "overlap_speedup": Goal(">=", 1.0, "throughput overlap on ÷ off, batch 16"),
    "tiers_prefill_ratio": Goal("<=", 0.5, "computed prefill fraction tiers on ÷ device only, slot_pressure"),
    "tiers_ttft_ratio": Goal(
        "<=",
        0.6,
        "mean modelled TTFT tiers on ÷ device only, slot_pressure below "
        "capacity (bench/tiers.py ClusterSettings.below_capacity)",
    ),
    "tiers_cached_vs_ray": Goal(">=", 1.15, "cached fraction hybrid_prefix ÷ Ray's rule, tiers on, slot_pressure"),
    "multi_turn_turn2_hits": Goal(">=", 20, "turn-2 prompts resuming from their turn-1 prompt, of 20, host tier on"),
    "eos_workload_speedup": Goal(
        ">=", 2.0, "engine ÷ transformers generate, ~100M Qwen3-Next, outputs ending at sampled lengths"
    ),
    "startup_cold_s": Goal("report", 0.0, "engine start-up with compilation, empty compile cache"),
    "startup_warm_s": Goal("report", 0.0, "engine start-up with compilation, warm compile cache"),
    "host_us_per_step_1": Goal("<=", 150, "host CPU us per step at batch 1, near-null Qwen3-Next, default engine"),
    "host_us_per_request_step_128": Goal("<=", 15, "host CPU us per request-step at batch 128, the same"),
    "host_us_per_request_step_256": Goal("<=", 15, "host CPU us per request-step at batch 256, the same"),
    "mtp_verified_per_request_step_32": Goal(
        ">=", 0.95, "sequences verified per step ÷ batch, MTP k=3 + overlap, batch 32"
    ),
    "mtp_overlapped_fraction_32": Goal(
        ">=", 0.9, "steps launched while the one before was in flight, MTP k=3 + overlap, batch 32"
    ),
}
