"""The configuration schema: DESIGN §3, field names are public surface.

One schema for every setting a user can change: the engine's sections here, the Serve
app's (``router``, ``replica``, ``ingress``) in ``serving.py``; each field carries its
one-line description, from which ``reference.py`` renders docs/configuration.md.
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
from pydantic import Field, ValidationError, model_validator

from configs.base import Frozen
from configs.serving import IngressConfig, PDConfig, ReplicaConfig, RouterConfig

_ROOT = Path(__file__).resolve().parent
DEFAULT_MODEL_DIR = "configs/models/qwen3-next-tiny-py"
logger = logging.getLogger(__name__)


class CacheConfig(Frozen):
    """The device pools and prefix caching; below them the host tier (``workers/tiers``:
    checkpoints evicted from the device are demoted there with the KV of their path and
    promoted back on a hit) and the cluster-wide store in Ray's object store
    (``cluster/store``; it needs the host tier: fetched checkpoints land there)."""

    enable_prefix_cache: bool = Field(True, description="reuse cached prefixes (KV pages and Mamba checkpoints)")
    page_size: int = Field(16, ge=1, description="tokens per KV page")
    mamba_strategy: Literal["no_buffer", "extra_buffer", "extra_buffer_lazy"] = Field(
        "extra_buffer_lazy",
        description="track slots a request writes checkpoints to: the live one, two, or one + a borrowed one",
    )
    mamba_track_interval: int = Field(256, ge=1, description="tokens between two checkpoints of a sequence")
    max_mamba_slots: int | None = Field(
        None, ge=1, description="usable recurrent-state slots (slot 0 is extra); null: sized from the scheduler"
    )
    max_kv_tokens: int | None = Field(
        None, ge=1, description="usable KV tokens (page 0 is extra); null: from the memory budget below"
    )
    # Pools sized from memory when max_kv_tokens is null (vLLM's kv_cache_memory_bytes and
    # SGLang's mem_fraction_static): the slots first, the KV pool takes the rest.
    kv_cache_memory_bytes: int | None = Field(
        None,
        ge=1,
        description="bytes of the device pools (KV, recurrent slots, speculation scratch) when "
        "max_kv_tokens is null; null: memory_fraction on CUDA, 32768 KV tokens elsewhere",
    )
    memory_fraction: float = Field(
        0.85,
        gt=0.0,
        le=1.0,
        description="CUDA, when max_kv_tokens and kv_cache_memory_bytes are null: the pools get this "
        "fraction of the device's memory less what is in use after loading (weights included)",
    )
    host_mamba_slots: int = Field(0, ge=0, description="checkpoint slots in host memory; 0: host tier off")
    host_kv_tokens: int = Field(0, ge=0, description="KV tokens in host memory; 0: host tier off")
    cluster_store_bytes: int = Field(0, ge=0, description="bytes of the cluster checkpoint store; 0: off")
    store_write_policy: Literal["write_back", "write_through", "write_through_selective"] = Field(
        "write_back",
        description="when checkpoints reach the store: demoted or hit; also every one published; "
        "also the prompts' own (prefill) ones",
    )

    @model_validator(mode="after")
    def _check_tiers(self) -> CacheConfig:
        host = (self.host_mamba_slots, self.host_kv_tokens)
        if (host[0] > 0) != (host[1] > 0):
            raise ValueError(
                f"cache.host_mamba_slots ({host[0]}) and cache.host_kv_tokens ({host[1]}) "
                "must both be 0 (host tier off) or both > 0"
            )
        if host[0] and not self.enable_prefix_cache:
            raise ValueError(f"cache.host_mamba_slots={host[0]} needs cache.enable_prefix_cache")
        if host[1] and host[1] < self.page_size:
            raise ValueError(
                f"cache.host_kv_tokens ({host[1]}) must hold one page of cache.page_size={self.page_size} tokens"
            )
        if self.max_kv_tokens is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError(
                f"cache.max_kv_tokens ({self.max_kv_tokens}) and cache.kv_cache_memory_bytes "
                f"({self.kv_cache_memory_bytes}) both size the KV pool: set one"
            )
        if self.cluster_store_bytes and not host[0]:
            raise ValueError(
                f"cache.cluster_store_bytes={self.cluster_store_bytes} needs the host tier "
                "(cache.host_mamba_slots and cache.host_kv_tokens > 0)"
            )
        return self

    @property
    def host_tier(self) -> bool:
        return self.host_mamba_slots > 0


class SchedulerConfig(Frozen):
    """``policy`` orders admission from the waiting queue: ``fcfs`` (arrival order) or
    ``lpm`` (longest cached prefix first, device or host tier, like SGLang's
    ``--schedule-policy lpm``; ties in arrival order). Under ``lpm`` a waiting request lets
    at most ``lpm_max_bypass`` younger requests be admitted before it; then it is next.
    Only the order changes: greedy outputs are the same under both."""

    max_running_requests: int = Field(64, ge=1, description="requests in the running batch at once")
    max_batch_tokens: int = Field(4096, ge=1, description="tokens one engine step computes at most")
    chunked_prefill_size: int = Field(512, ge=1, description="prompt tokens of one request per step at most")
    overlap: bool = Field(True, description="schedule the next step while the current one runs")
    policy: Literal["fcfs", "lpm"] = Field("fcfs", description="admission order: arrival, or longest cached prefix")
    lpm_max_bypass: int = Field(8, ge=0, description="under lpm, younger requests admitted before a waiting one")


class SpecConfig(Frozen):
    method: Literal["none", "mtp"] = Field(
        "none", description="speculative decoding: none, or mtp (the model's own MTP head)"
    )
    num_draft_tokens: int = Field(3, ge=1, description="tokens drafted per step")
    # Drafts only: verification scores the whole vocabulary, so outputs are unchanged.
    draft_vocab: str | None = Field(
        "auto", description="tokens the drafter scores: auto (the model's draft_vocab.json), null (all), or a path"
    )


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


class CompileConfig(Frozen):
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

    enabled: bool = Field(
        default_factory=compile_default,
        json_schema_extra={"shown_default": "true"},
        description=f"compiled decode steps; default on unless {COMPILE_DEFAULT_ENV}=0",
    )
    batch_sizes: tuple[int, ...] = Field((1, 2, 4, 8, 16, 32), description="one compiled graph per batch size")
    cache_dir: str | None = Field(None, description="persistent inductor caches; null: TORCHINDUCTOR_CACHE_DIR")
    # Off by default: the persistent caches refuse frozen, packed graphs, so every start-up
    # would compile them again for a step a little faster at larger batches (BENCHMARKS.md).
    pack_weights: bool = Field(False, description="CPU: freeze and pack the weights into the compiled steps")

    @model_validator(mode="after")
    def _check_sizes(self) -> CompileConfig:
        sizes = self.batch_sizes
        if not sizes or any(b < 1 for b in sizes) or list(sizes) != sorted(set(sizes)):
            raise ValueError(f"compile.batch_sizes must be increasing positive sizes, got {list(sizes)}")
        return self


class ParallelConfig(Frozen):
    tensor_parallel_size: int = Field(1, ge=1, description="ranks one engine replica is sharded over")
    num_replicas: int = Field(1, ge=1, description="engine replicas (each a whole engine)")


class ServerConfig(Frozen):
    host: str = Field("127.0.0.1", description="the OpenAI API's address; 0.0.0.0 listens on every interface")
    port: int = Field(8000, ge=0, le=65535, description="the OpenAI API's port")
    api_key: str | None = Field(None, description="bearer key every route but /health needs; null: open")
    served_model_name: str | None = Field(
        None, description="the model id the API answers to; null: the model directory's name"
    )
    tool_call_parser: Literal["auto", "hermes", "qwen3_xml", "none"] = Field(
        "auto", description="tool-call format in chat outputs; auto reads the chat template, none: off"
    )
    reasoning_parser: Literal["auto", "qwen3", "none"] = Field(
        "auto", description="think-block text to reasoning_content; auto reads the chat template, none: off"
    )
    trust_request_chat_template: bool = Field(
        False, description="accept a request's own chat_template (Jinja, sandboxed)"
    )


class MetricsConfig(Frozen):
    port: int = Field(9464, ge=0, le=65535, description="the Prometheus /metrics port")


class DebugConfig(Frozen):
    check_invariants: bool = Field(False, description="check the ledger's invariants every step")
    fail_pending_alloc_prob: float = Field(
        0.0, ge=0.0, le=1.0, description="fault injection: probability that a pending allocation fails"
    )
    disable_alias_guard: bool = Field(False, description="turn off the guard against aliased state slots")
    state_oracle_sample: float = Field(
        0.0, ge=0.0, le=1.0, description="fraction of checkpoints recomputed by a fresh prefill and compared (TP = 1)"
    )
    fail_transfer_prob: float = Field(
        0.0, ge=0.0, le=1.0, description="fault injection: probability that a host <-> device copy fails"
    )


class HybridServeConfig(Frozen):
    model: str = Field(DEFAULT_MODEL_DIR, description="the model directory (relative: to cwd, else the repository)")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field("auto", description="weights and activations")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available")
    fp8_weights: bool = Field(
        False,
        description="an FP8 checkpoint's projections stay FP8 and multiply in FP8 (kernels/fp8); "
        "false: dequantized at load. Not yet with tensor parallelism",
    )
    seed: int = Field(0, description="sampling seed of requests without their own")
    max_model_len: int | None = Field(
        None, ge=2, description="longest sequence (prompt + output); null: what the model and the KV pool allow"
    )
    deterministic: bool = Field(
        False,
        description="batch-invariant kernels: a request's bits do not depend on its batch (fp32 CPU, eager, TP 1; "
        "slower prefill)",
    )
    cache: CacheConfig = Field(CacheConfig(), description="device pools, prefix caching and the tiers")
    scheduler: SchedulerConfig = Field(SchedulerConfig(), description="admission and batching")
    spec: SpecConfig = Field(SpecConfig(), description="speculative decoding")
    compile: CompileConfig = Field(
        default_factory=CompileConfig,  # its default read at each load
        description="compiled decode steps",
    )
    parallel: ParallelConfig = Field(ParallelConfig(), description="tensor parallelism and engine replicas")
    router: RouterConfig = Field(RouterConfig(), description="which engine replica serves a request")
    replica: ReplicaConfig = Field(ReplicaConfig(), description="each engine replica's Serve deployment")
    ingress: IngressConfig = Field(IngressConfig(), description="the HTTP ingress deployment")
    pd: PDConfig = Field(PDConfig(), description="prefill/decode disaggregation")
    server: ServerConfig = Field(ServerConfig(), description="the OpenAI API")
    metrics: MetricsConfig = Field(MetricsConfig(), description="Prometheus metrics")
    debug: DebugConfig = Field(DebugConfig(), description="checks and fault injection")

    @model_validator(mode="after")
    def _check_cross_fields(self) -> HybridServeConfig:
        sched = self.scheduler
        if sched.chunked_prefill_size > sched.max_batch_tokens:
            raise ValueError(
                f"scheduler.chunked_prefill_size ({sched.chunked_prefill_size}) must be <= "
                f"scheduler.max_batch_tokens ({sched.max_batch_tokens})"
            )
        tp = self.parallel.tensor_parallel_size
        if self.cache.host_tier and tp > 1:
            raise ValueError(
                f"cache.host_mamba_slots={self.cache.host_mamba_slots} (the host tier) needs "
                f"parallel.tensor_parallel_size=1, got {tp}"
            )
        if self.replica.resources and tp > 1:
            raise ValueError(
                f"replica.resources {self.replica.resources} needs "
                f"parallel.tensor_parallel_size=1 (a TP replica is placed by its placement "
                f"group), got {tp}"
            )
        if self.pd.enabled and not (self.cache.enable_prefix_cache and self.cache.host_tier):
            raise ValueError(
                "pd (prefill/decode disaggregation) needs cache.enable_prefix_cache and the host tier "
                f"(cache.host_mamba_slots, cache.host_kv_tokens > 0), got {self.cache.enable_prefix_cache}, "
                f"{self.cache.host_mamba_slots}, {self.cache.host_kv_tokens}"
            )
        if self.deterministic and tp > 1:
            raise ValueError(f"deterministic needs parallel.tensor_parallel_size=1, got {tp}")
        if self.fp8_weights and (tp > 1 or self.deterministic):
            raise ValueError(
                f"fp8_weights needs parallel.tensor_parallel_size=1 and deterministic off, got {tp} and "
                f"{self.deterministic} (FP8 scales are not sharded yet; FP8 products are not batch invariant)"
            )
        if self.compile.enabled and tp > 1:  # a default must not make a TP config invalid
            logger.warning(
                "compile.enabled with parallel.tensor_parallel_size=%d: the engine runs eager "
                "(compiled steps are single-rank)",
                tp,
            )
        return self

    def model_dir(self) -> Path:
        """The model path, resolved against the project root when relative and absent here."""
        path = Path(self.model)
        if path.is_absolute() or path.exists():
            return path
        return _ROOT.parent / path

    def served_model_name(self) -> str:
        """The model id of the API: ``server.served_model_name``, else the directory's name."""
        return self.server.served_model_name or Path(self.model).name


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


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested or dotted keys -> ``{"a.b": leaf}``; an empty mapping is a leaf."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = prefix + str(key).replace("-", "_")
        if isinstance(value, dict) and value:
            out.update(_flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def combine_overrides(sources: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Overrides from several named sources (``--port`` and ``--set``, say) as one nested
    dict; a key two sources give different values is a ValueError naming both."""
    seen: dict[str, tuple[str, Any]] = {}
    for source, tree in sources.items():
        for key, value in _flatten(tree).items():
            if key in seen and seen[key][1] != value:
                raise ValueError(f"{key} is {seen[key][1]!r} by {seen[key][0]} but {value!r} by {source}")
            seen[key] = (source, value)
    out: dict[str, Any] = {}
    for key, (_, value) in seen.items():
        _set_dotted(out, key, value)
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


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> HybridServeConfig:
    """Defaults <- YAML file <- overrides. Raises ValueError naming unknown or bad keys."""
    data: dict[str, Any] = {}
    if path is not None:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"config file {path} must hold a mapping, got {type(loaded).__name__}")
        data = loaded
    return _validate(_deep_merge(data, overrides or {}))


def _validate(data: dict[str, Any]) -> HybridServeConfig:
    try:
        return HybridServeConfig.model_validate(data)
    except ValidationError as exc:
        raise ValueError(_describe(exc)) from None


def with_overrides(config: HybridServeConfig, overrides: dict[str, Any]) -> HybridServeConfig:
    """``config`` with dotted or nested overrides, validated as ``load_config`` validates."""
    return _validate(_deep_merge(config.model_dump(), overrides))


def _describe(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "<root>"
        if err["type"] == "extra_forbidden":
            lines.append(f"unknown config key {where!r}")
        else:
            lines.append(f"{where}: {err['msg']} (got {err.get('input')!r})")
    return "invalid config: " + "; ".join(lines)
