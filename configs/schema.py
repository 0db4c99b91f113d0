"""The configuration schema: DESIGN §3, field names are public surface.

Every model is frozen and rejects unknown keys (pydantic ``extra="forbid"``), so a typo
in YAML or ``--set`` fails loudly with the key named. ``load_config`` merges, in order:
defaults, a YAML file, a dict of overrides (nested or dotted keys).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

_ROOT = Path(__file__).resolve().parent
DEFAULT_MODEL_DIR = "configs/models/qwen3-next-tiny-py"
logger = logging.getLogger(__name__)


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CacheConfig(_Frozen):
    enable_prefix_cache: bool = True
    page_size: int = Field(16, ge=1)
    mamba_strategy: Literal["no_buffer", "extra_buffer", "extra_buffer_lazy"] = "extra_buffer_lazy"
    mamba_track_interval: int = Field(256, ge=1)
    max_mamba_slots: int | None = Field(None, ge=1)  # usable slots (slot 0 is extra)
    max_kv_tokens: int | None = Field(None, ge=1)    # usable KV tokens (page 0 is extra)
    # The host-memory tier below the device pools (workers/tiers): checkpoints evicted from
    # the device are demoted there with the KV of their path and promoted back on a hit.
    # Sized independently; both 0 (the default) = off, both > 0 = on.
    host_mamba_slots: int = Field(0, ge=0)           # checkpoint slots in host memory
    host_kv_tokens: int = Field(0, ge=0)             # KV tokens in host memory
    # The cluster-wide checkpoint store in Ray's object store (cluster/store); 0 = off.
    # Needs the host tier: fetched checkpoints land there before they are promoted.
    cluster_store_bytes: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _check_tiers(self) -> CacheConfig:
        host = (self.host_mamba_slots, self.host_kv_tokens)
        if (host[0] > 0) != (host[1] > 0):
            raise ValueError(f"cache.host_mamba_slots ({host[0]}) and cache.host_kv_tokens ({host[1]}) "
                             "must both be 0 (host tier off) or both > 0")
        if host[0] and not self.enable_prefix_cache:
            raise ValueError(f"cache.host_mamba_slots={host[0]} needs cache.enable_prefix_cache")
        if host[1] and host[1] < self.page_size:
            raise ValueError(f"cache.host_kv_tokens ({host[1]}) must hold one page of "
                             f"cache.page_size={self.page_size} tokens")
        if self.cluster_store_bytes and not host[0]:
            raise ValueError(f"cache.cluster_store_bytes={self.cluster_store_bytes} needs the host tier "
                             "(cache.host_mamba_slots and cache.host_kv_tokens > 0)")
        return self

    @property
    def host_tier(self) -> bool:
        return self.host_mamba_slots > 0


class SchedulerConfig(_Frozen):
    """``policy`` orders admission from the waiting queue: ``fcfs`` (arrival order) or
    ``lpm`` (longest cached prefix first, device or host tier, like SGLang's
    ``--schedule-policy lpm``; ties in arrival order). Under ``lpm`` a waiting request lets
    at most ``lpm_max_bypass`` younger requests be admitted before it; then it is next.
    Only the order changes: greedy outputs are the same under both."""

    max_running_requests: int = Field(64, ge=1)
    max_batch_tokens: int = Field(4096, ge=1)
    chunked_prefill_size: int = Field(512, ge=1)
    overlap: bool = True
    policy: Literal["fcfs", "lpm"] = "fcfs"
    lpm_max_bypass: int = Field(8, ge=0)


class SpecConfig(_Frozen):
    method: Literal["none", "mtp", "draft"] = "none"
    num_draft_tokens: int = Field(3, ge=1)
    # The tokens the drafter scores (SGLang's speculative token map, FR-Spec): "auto" takes the
    # model directory's draft_vocab.json when it has one, else every token; null: every
    # token; a path: that file ({"token_ids": [...]}, most frequent first). Drafts only:
    # verification scores the whole vocabulary, so outputs are unchanged (greedy: exactly).
    draft_vocab: str | None = "auto"


COMPILE_DEFAULT_ENV = "HYBRIDSERVE_COMPILE_DEFAULT"


def compile_default() -> bool:
    """``compile.enabled`` where a config does not set it: on, unless the environment's
    ``HYBRIDSERVE_COMPILE_DEFAULT`` is 0 / false / off (the test suite's conftest sets it:
    its engines run eager unless a test compiles). A value set in the config always wins."""
    raw = os.environ.get(COMPILE_DEFAULT_ENV, "1").strip().lower()
    if raw not in _SWITCH:
        raise ValueError(f"{COMPILE_DEFAULT_ENV} must be one of {sorted(_SWITCH)}, got {raw!r}")
    return _SWITCH[raw]


_SWITCH = {"1": True, "true": True, "on": True, "0": False, "false": False, "off": False}


class CompileConfig(_Frozen):
    """Compiled decode steps (vLLM's ``compilation_config`` / ``enforce_eager`` in one switch).

    With ``enabled`` (the default; ``compile_default``), decode-only batches run through one
    shape-static compiled callable per size in ``batch_sizes`` (a batch is padded up to the
    next size, like vLLM's CUDA-graph capture sizes; larger batches, prefill and mixed
    batches stay eager): inductor on CPU, inductor + CUDA graphs (``mode="reduce-overhead"``)
    on GPU. Every size is compiled at start-up, a line each on stderr; ``cache_dir``
    (default: inductor's, ``TORCHINDUCTOR_CACHE_DIR``) holds the persistent FX-graph /
    AOT-autograd caches, so a restart over a warm cache loads every graph (seconds) instead
    of compiling it (minutes on a CPU). ``enabled: false`` runs eager. Tensor parallelism
    runs eager whatever this says (logged).
    """

    enabled: bool = Field(default_factory=compile_default)
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    cache_dir: str | None = None
    # CPU: freeze the weights into the compiled steps (inductor ``freezing``) and pack them
    # for inductor's GEMMs (``max_autotune``, backends CPP + ATen). Off by default: both
    # persistent caches refuse frozen, packed graphs, so every start-up would compile them
    # again (minutes) for a step a little faster from 8 rows up (BENCHMARKS.md). GPU: unused.
    pack_weights: bool = False

    @model_validator(mode="after")
    def _check_sizes(self) -> CompileConfig:
        sizes = self.batch_sizes
        if not sizes or any(b < 1 for b in sizes) or list(sizes) != sorted(set(sizes)):
            raise ValueError(f"compile.batch_sizes must be increasing positive sizes, got {list(sizes)}")
        return self


class ParallelConfig(_Frozen):
    tensor_parallel_size: int = Field(1, ge=1)
    num_replicas: int = Field(1, ge=1)


class RouterConfig(_Frozen):
    policy: Literal["hybrid_prefix", "pow2", "round_robin"] = "hybrid_prefix"


class ServerConfig(_Frozen):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: str | None = None
    # how chat outputs are parsed; ``auto`` reads the model's chat template (``<function=``:
    # qwen3_xml, ``<tool_call>``: hermes; ``<think>``: qwen3), ``none`` turns parsing off
    tool_call_parser: Literal["auto", "hermes", "qwen3_xml", "none"] = "auto"
    reasoning_parser: Literal["auto", "qwen3", "none"] = "auto"
    # a request's own ``chat_template`` (Jinja, sandboxed) is refused unless this is set
    trust_request_chat_template: bool = False


class MetricsConfig(_Frozen):
    port: int = Field(9464, ge=0, le=65535)


class DebugConfig(_Frozen):
    check_invariants: bool = False
    fail_pending_alloc_prob: float = Field(0.0, ge=0.0, le=1.0)
    disable_alias_guard: bool = False
    # Fraction of published checkpoints recomputed by a fresh prefill of their path and
    # compared with the slot (hybridserve_state_oracle_{checks,mismatches}_total); TP = 1.
    state_oracle_sample: float = Field(0.0, ge=0.0, le=1.0)
    # Fault injection for the tiers: make host <-> device copies fail (demotion: dropped,
    # promotion: the request recomputes from what the device held).
    fail_transfer_prob: float = Field(0.0, ge=0.0, le=1.0)


class HybridServeConfig(_Frozen):
    model: str = DEFAULT_MODEL_DIR
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = 0
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    spec: SpecConfig = SpecConfig()
    compile: CompileConfig = Field(default_factory=CompileConfig)    # its default read at each load
    parallel: ParallelConfig = ParallelConfig()
    router: RouterConfig = RouterConfig()
    server: ServerConfig = ServerConfig()
    metrics: MetricsConfig = MetricsConfig()
    debug: DebugConfig = DebugConfig()

    @model_validator(mode="after")
    def _check_cross_fields(self) -> HybridServeConfig:
        sched = self.scheduler
        if sched.chunked_prefill_size > sched.max_batch_tokens:
            raise ValueError(
                f"scheduler.chunked_prefill_size ({sched.chunked_prefill_size}) must be <= "
                f"scheduler.max_batch_tokens ({sched.max_batch_tokens})")
        tp = self.parallel.tensor_parallel_size
        if self.cache.host_tier and tp > 1:
            raise ValueError(f"cache.host_mamba_slots={self.cache.host_mamba_slots} (the host tier) needs "
                             f"parallel.tensor_parallel_size=1, got {tp}")
        if self.compile.enabled and tp > 1:      # a default must not make a TP config invalid
            logger.warning("compile.enabled with parallel.tensor_parallel_size=%d: the engine runs eager "
                           "(compiled steps are single-rank)", tp)
        return self

    def model_dir(self) -> Path:
        """The model path, resolved against the project root when relative and absent here."""
        path = Path(self.model)
        if path.is_absolute() or path.exists():
            return path
        return _ROOT.parent / path


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.replace("-", "_").split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"cannot set {dotted!r}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if "." in key:
            tmp: dict[str, Any] = {}
            _set_dotted(tmp, key, value)
            out = _deep_merge(out, tmp)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def parse_set_items(items: list[str]) -> dict[str, Any]:
    """``["cache.page_size=8", ...]`` -> nested dict; values are parsed as YAML scalars."""
    tree: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects key=value, got {item!r}")
        _set_dotted(tree, key.strip(), yaml.safe_load(raw) if raw.strip() else None)
    return tree


def load_config(path: str | Path | None = None,
                overrides: dict[str, Any] | None = None) -> HybridServeConfig:
    """Defaults <- YAML file <- overrides. Raises ValueError naming unknown or bad keys."""
    data: dict[str, Any] = {}
    if path is not None:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"config file {path} must hold a mapping, got {type(loaded).__name__}")
        data = loaded
    data = _deep_merge(data, overrides or {})
    try:
        return HybridServeConfig.model_validate(data)
    except ValidationError as exc:
        raise ValueError(_describe(exc)) from None


def _describe(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "<root>"
        if err["type"] == "extra_forbidden":
            lines.append(f"unknown config key {where!r}")
        else:
            lines.append(f"{where}: {err['msg']} (got {err.get('input')!r})")
    return "invalid config: " + "; ".join(lines)
