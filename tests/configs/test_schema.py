from __future__ import annotations

import pytest

from configs.schema import HybridServeConfig, load_config, parse_set_items


def test_defaults_match_design():
    c = HybridServeConfig()
    assert c.cache.page_size == 16
    assert c.cache.mamba_strategy == "extra_buffer_lazy"
    assert c.cache.mamba_track_interval == 256
    assert c.scheduler.chunked_prefill_size == 512
    assert c.scheduler.overlap is True
    assert c.spec.method == "none" and c.spec.num_draft_tokens == 3
    assert c.router.policy == "hybrid_prefix"
    assert (c.server.host, c.server.port, c.metrics.port) == ("127.0.0.1", 8000, 9464)
    assert c.debug.check_invariants is False


def test_unknown_key_is_named():
    with pytest.raises(ValueError, match="unknown config key 'cache.bogus'"):
        load_config(overrides={"cache": {"bogus": 1}})
    with pytest.raises(ValueError, match="unknown config key 'nonsense'"):
        load_config(overrides={"nonsense": 1})


def test_bad_value_names_field_and_value():
    with pytest.raises(ValueError, match=r"cache.mamba_strategy.*'lazy'"):
        load_config(overrides={"cache.mamba_strategy": "lazy"})
    with pytest.raises(ValueError, match="chunked_prefill_size"):
        load_config(overrides={"scheduler": {"chunked_prefill_size": 9000}})


def test_yaml_then_dotted_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("cache:\n  page_size: 4\nscheduler:\n  overlap: false\n")
    c = load_config(f, parse_set_items(["cache.mamba-track-interval=64", "seed=7", "spec.method=mtp"]))
    assert c.cache.page_size == 4 and c.cache.mamba_track_interval == 64
    assert c.scheduler.overlap is False and c.seed == 7 and c.spec.method == "mtp"


def test_config_is_frozen():
    c = HybridServeConfig()
    with pytest.raises(Exception):
        c.seed = 3  # type: ignore[misc]


def test_set_item_syntax_error():
    with pytest.raises(ValueError, match="key=value"):
        parse_set_items(["cache.page_size"])


@pytest.mark.parametrize("preset", ["default.yaml", "cpu-small.yaml"])
def test_presets_load(preset):
    from pathlib import Path

    load_config(Path(__file__).resolve().parents[2] / "configs" / "presets" / preset)


def test_compile_section_checks_its_sizes_and_tp():
    cfg = load_config(overrides={"compile.enabled": True, "compile.batch_sizes": [1, 4]})
    assert cfg.compile.enabled and cfg.compile.batch_sizes == (1, 4) and cfg.compile.cache_dir is None
    for bad in ([], [4, 1], [0, 2], [2, 2]):
        with pytest.raises(ValueError, match="compile.batch_sizes"):
            load_config(overrides={"compile": {"batch_sizes": bad}})
    # TP > 1 runs eager (logged), not refused: compiled is the default
    # (tests/workers/compiled/test_default.py)
    tp2 = {"compile.enabled": True, "parallel.tensor_parallel_size": 2}
    assert load_config(overrides=tp2).compile.enabled
