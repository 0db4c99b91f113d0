"""``hybridserve serve``'s arguments: vLLM's flags land on their config keys, ``--set``
reaches every documented setting, and a flag and a ``--set`` that disagree are refused."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from cluster.cli import VLLM_FLAGS, build_parser, config_from_args, main
from configs.reference import REFERENCE_PATH, sections, setting
from configs.schema import load_config

ROOT = Path(__file__).resolve().parents[2]
# Written out here, not read from VLLM_FLAGS, so that a flag mapped to the wrong key fails.
EXPECTED = {
    "--tensor-parallel-size": ("parallel.tensor_parallel_size", "2", 2),
    "--host": ("server.host", "0.0.0.0", "0.0.0.0"),
    "--port": ("server.port", "8123", 8123),
    "--max-model-len": ("max_model_len", "512", 512),
    "--served-model-name": ("server.served_model_name", "my-model", "my-model"),
    "--api-key": ("server.api_key", "sk-test", "sk-test"),
    "--dtype": ("dtype", "bfloat16", "bfloat16"),
    "--seed": ("seed", "7", 7),
    "--max-num-seqs": ("scheduler.max_running_requests", "9", 9),
    "--max-num-batched-tokens": ("scheduler.max_batch_tokens", "2048", 2048),
}
SECTIONS = "|".join(s.name for s in sections() if s.name)
# a dotted setting in backticks (`router.host_hit_value`, `--set cache.page_size=8`), not a file name
DOTTED = re.compile(rf"(?<![\w/.])((?:{SECTIONS})\.[a-z_]+)\b(?!\.py|/)")


def _value(config, key: str):
    for part in key.split("."):
        config = getattr(config, part)
    return config


def _serve_config(*argv: str):
    return config_from_args(build_parser().parse_args(["serve", *argv]))


def documented_keys() -> set[str]:
    """The dotted settings the README and the reference name inside backticks, and the
    reference's rows (top-level keys too)."""
    reference = REFERENCE_PATH.read_text()
    text = (ROOT / "README.md").read_text() + reference
    dotted = {m for span in re.findall(r"`([^`\n]+)`", text) for m in DOTTED.findall(span)}
    return dotted | set(re.findall(r"(?m)^\| `([a-z_.]+)` \|", reference))


def test_serve_takes_the_model_dir_and_vllms_flags():
    assert {f.flag for f in VLLM_FLAGS} == set(EXPECTED)
    argv = [arg for flag, (_, raw, _) in EXPECTED.items() for arg in (flag, raw)]
    config = _serve_config("configs/models/tiny-hybrid", *argv)
    assert config.model == "configs/models/tiny-hybrid"
    assert {flag: _value(config, key) for flag, (key, _, _) in EXPECTED.items()} == {
        flag: value for flag, (_, _, value) in EXPECTED.items()
    }
    assert config.served_model_name() == "my-model"


def test_each_flag_is_the_same_as_a_set_of_its_key():
    for flag, (key, raw, _) in EXPECTED.items():
        assert _serve_config(flag, raw) == _serve_config("--set", f"{key}={raw}"), flag


def test_a_flag_and_a_set_that_disagree_are_refused(capsys):
    assert _serve_config("--port", "8001", "--set", "server.port=8001").server.port == 8001
    with pytest.raises(ValueError, match=r"server.port is 8001 by --port but 8002 by --set"):
        _serve_config("--port", "8001", "--set", "server.port=8002")
    with pytest.raises(ValueError, match=r"model is 'a' by MODEL_DIR but 'b' by --set"):
        _serve_config("a", "--set", "model=b")
    assert main(["serve", "--max-model-len", "64", "--set", "max_model_len=32"]) == 2
    assert "max_model_len is 64 by --max-model-len but 32 by --set" in capsys.readouterr().err


def test_flags_win_over_the_config_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("server:\n  port: 9000\n  host: 0.0.0.0\n")
    config = _serve_config("--config", str(f), "--port", "9100")
    assert (config.server.port, config.server.host) == (9100, "0.0.0.0")


def test_every_documented_setting_is_accepted_by_set_and_yaml(tmp_path):
    documented = documented_keys()
    assert {
        "router.host_hit_value",
        "replica.stream_interval_s",
        "replica.prefill_tokens_per_s",
        "ingress.max_body_bytes",
        "cache.page_size",
        "max_model_len",
    } <= documented
    unknown = [key for key in sorted(documented) if not _known(key)]
    assert not unknown, f"documented but not in configs/schema.py: {unknown}"
    for key in sorted(documented):
        raw = setting(key).default
        value = yaml.safe_load(raw)
        value = tuple(value) if isinstance(value, list) else value
        assert _value(_serve_config("--set", f"{key}={raw}"), key) == value, key
        nested: dict = {}
        node = nested
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(raw)
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump(nested))
        assert _value(load_config(path), key) == value, key


def _known(key: str) -> bool:
    try:
        setting(key)
    except KeyError:
        return False
    return True
