"""The app builder and the serve YAML: arguments are validated before anything starts."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest
import yaml

from cluster.app import AppArgs, build_app, build_app_from_config
from cluster.serve_local import endpoint_urls
from configs.schema import load_config, with_overrides

ROOT = Path(__file__).resolve().parents[2]


def _serve_yaml_args() -> dict:
    return yaml.safe_load((ROOT / "deploy" / "serve.yaml").read_text())["applications"][0]["args"]


def test_shipped_serve_yaml_builds_the_app():
    app = build_app(_serve_yaml_args())
    assert type(app).__name__ == "Application"


def test_shipped_pd_yaml_builds_prefill_and_decode_deployments():
    args = yaml.safe_load((ROOT / "deploy" / "serve-pd.yaml").read_text())["applications"][0]["args"]
    app = build_app(args)
    decode, _config, prefill = app._bound_deployment.init_args
    assert (decode._bound_deployment.name, prefill._bound_deployment.name) == ("PDDecode", "PDPrefill")
    assert (decode._bound_deployment.init_args[1], prefill._bound_deployment.init_args[1]) == ("decode", "prefill")
    with pytest.raises(ValueError, match="needs cache.enable_prefix_cache and the host tier"):
        build_app({"pd": {"prefill_replicas": 1, "decode_replicas": 1}})
    with pytest.raises(ValueError, match="must both be 0"):
        build_app({"pd": {"prefill_replicas": 1}})


@pytest.mark.parametrize("manifest", ["rayservice.yaml", "rayservice-pd.yaml"])
def test_kuberay_manifest_embeds_a_valid_serve_config(manifest):
    from ray.serve.schema import ServeDeploySchema

    spec = yaml.safe_load((ROOT / "deploy" / manifest).read_text())["spec"]
    serve_config = ServeDeploySchema.model_validate(yaml.safe_load(spec["serveConfigV2"]))
    args = serve_config.applications[0].args
    assert serve_config.applications[0].import_path == "cluster.app:build_app"
    assert type(build_app(args)).__name__ == "Application"


def test_unknown_arguments_and_indivisible_tensor_parallel_are_refused():
    with pytest.raises(pydantic.ValidationError, match="bogus"):
        build_app({"bogus": 1})
    with pytest.raises(ValueError, match="unknown config key"):
        build_app({"set": {"cache.nope": 1}})
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide .*num_attention_heads=4"):
        build_app_from_config(load_config(overrides={"parallel.tensor_parallel_size": 3}), AppArgs())


def test_tensor_parallel_replicas_get_one_bundle_per_rank():
    config = load_config(overrides={"parallel.tensor_parallel_size": 2, "device": "cpu"})
    app = build_app_from_config(config, AppArgs())
    engine = app._bound_deployment.init_args[0]._bound_deployment
    assert engine._replica_config.placement_group_bundles == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert engine._replica_config.placement_group_strategy == "STRICT_PACK"


def test_endpoint_urls_show_a_reachable_host():
    config = load_config(overrides={"server": {"host": "0.0.0.0", "port": 8123}, "metrics.port": 9999})
    assert endpoint_urls(config) == ("http://127.0.0.1:8123/v1", "http://127.0.0.1:9999/metrics")


def test_the_router_knows_how_many_requests_a_replica_runs_at_once():
    from cluster.routing.routing_policy import RouterSettings

    config = load_config(overrides={"scheduler.max_running_requests": 7})
    assert RouterSettings.from_config(config).replica_capacity == 7
    overridden = with_overrides(config, AppArgs(router={"replica_capacity": 2}).overrides())
    assert RouterSettings.from_config(overridden).replica_capacity == 2


def test_builder_sections_and_set_reach_every_deployment_as_one_config():
    app = build_app(
        {
            "model_name": "served",
            "replica": {"max_ongoing_requests": 7},
            "ingress": {"max_body_bytes": 1234, "num_replicas": 2},
            "set": {"router.host_hit_value": 0.8, "replica.stream_interval_s": 0.0},
        }
    )
    ingress = app._bound_deployment
    engine = ingress.init_args[0]._bound_deployment
    config = load_config(overrides=engine.init_args[0])
    assert ingress.init_args[1] == engine.init_args[0]
    assert (config.replica.max_ongoing_requests, config.replica.stream_interval_s) == (7, 0.0)
    assert (config.router.host_hit_value, config.ingress.max_body_bytes) == (0.8, 1234)
    assert config.served_model_name() == "served"
    assert engine._deployment_config.max_ongoing_requests == 7
    assert ingress._deployment_config.num_replicas == 2
    router = engine._deployment_config.request_router_config
    assert router.request_router_kwargs == {"config": engine.init_args[0]}


def test_a_section_and_a_set_of_the_same_key_must_agree():
    with pytest.raises(ValueError, match=r"router.min_match_tokens is 4 by args but 8 by args.set"):
        build_app({"router": {"min_match_tokens": 4}, "set": {"router.min_match_tokens": 8}})
    with pytest.raises(ValueError, match=r"unknown config key 'replica.bogus'"):
        build_app({"replica": {"bogus": 1}})
