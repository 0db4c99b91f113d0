"""The cluster's settings classes are views of the config: built from it, they hold its
values, and their defaults are its defaults."""

from __future__ import annotations

from dataclasses import fields

from cluster.api.openai_server import ServerSettings
from cluster.routing.routing_policy import RouterSettings
from cluster.serving.replica_core import StreamPacing
from cluster.store.client import FetchSettings
from configs.schema import HybridServeConfig, load_config

# every field of every view set away from its default
CONFIG = load_config(
    overrides={
        "router": {
            "load_penalty_tokens": 3.0,
            "load_penalty_auto": False,
            "imbalance_abs": 2,
            "imbalance_rel": 2.5,
            "min_match_tokens": 5,
            "host_hit_value": 0.7,
            "store_hit_value": 0.3,
            "store_min_gain_tokens": 11,
            "replica_capacity": 4,
        },
        "replica": {
            "stream_interval_s": 0.02,
            "stream_items_per_s": 50.0,
            "max_stream_interval_s": 0.5,
            "store_bandwidth_bytes_per_s": 5e8,
            "store_latency_s": 0.01,
            "prefill_tokens_per_s": 123.0,
            "store_fetch_timeout_s": 3.0,
        },
        "server": {
            "api_key": "k",
            "served_model_name": "served",
            "tool_call_parser": "hermes",
            "reasoning_parser": "none",
            "trust_request_chat_template": True,
        },
        "ingress.max_body_bytes": 1234,
    }
)
FETCH_KEYS = {
    "bandwidth_bytes_per_s": "store_bandwidth_bytes_per_s",
    "latency_s": "store_latency_s",
    "prefill_tokens_per_s": "prefill_tokens_per_s",
    "timeout_s": "store_fetch_timeout_s",
}
SERVER_KEYS = ("api_key", "tool_call_parser", "reasoning_parser", "trust_request_chat_template")


def _pick(obj, keys) -> dict:
    return {k: getattr(obj, k) for k in keys}


def _replica_priors(replica) -> dict:
    """The replica section's store priors under ``FetchSettings``' names."""
    return {name: getattr(replica, key) for name, key in FETCH_KEYS.items()}


def test_router_settings_hold_the_router_section():
    keys = [f.name for f in fields(RouterSettings)]
    assert _pick(RouterSettings.from_config(CONFIG), keys) == _pick(CONFIG.router, keys)
    default = HybridServeConfig()
    assert _pick(RouterSettings(), keys) == _pick(default.router, keys)
    assert RouterSettings.from_config(default).replica_capacity == default.scheduler.max_running_requests


def test_fetch_settings_hold_the_replica_store_priors():
    for config in (CONFIG, HybridServeConfig()):
        view = FetchSettings.from_config(config.replica)
        assert _pick(view, FETCH_KEYS) == _replica_priors(config.replica)
    assert _pick(FetchSettings(), FETCH_KEYS) == _replica_priors(HybridServeConfig().replica)


def test_server_settings_hold_the_server_section_and_the_body_limit():
    view = ServerSettings.from_config(CONFIG)
    assert view.model_name == "served" and view.max_body_bytes == 1234
    assert _pick(view, SERVER_KEYS) == _pick(CONFIG.server, SERVER_KEYS)
    assert ServerSettings.from_config(CONFIG, "bench").model_name == "bench"
    default, bare = HybridServeConfig(), ServerSettings("m", "/root")
    assert _pick(bare, SERVER_KEYS) == _pick(default.server, SERVER_KEYS)
    assert bare.max_body_bytes == default.ingress.max_body_bytes
    assert ServerSettings.from_config(default).model_name == "qwen3-next-tiny-py"


def test_stream_pacing_holds_the_replica_stream_settings():
    pacing = StreamPacing.from_config(CONFIG.replica)
    assert (pacing.interval_s, pacing.items_per_s, pacing.max_interval_s) == (0.02, 50.0, 0.5)
