"""Compiled steps are the default: ``compile.enabled`` unset means on, unless the
environment's ``HYBRIDSERVE_COMPILE_DEFAULT`` turns the default off (the test suite's
conftest does); a config that sets it wins either way, and a bad value is named. A
tensor-parallel config with compilation on is valid and logs that it runs eager."""

from __future__ import annotations

import logging

import pytest

from configs.schema import COMPILE_DEFAULT_ENV, load_config


def test_compiled_unless_the_environment_or_the_config_says_otherwise(monkeypatch):
    monkeypatch.delenv(COMPILE_DEFAULT_ENV, raising=False)
    assert load_config().compile.enabled
    assert not load_config(overrides={"compile.enabled": False}).compile.enabled
    monkeypatch.setenv(COMPILE_DEFAULT_ENV, "off")
    assert not load_config().compile.enabled
    assert load_config(overrides={"compile.enabled": True}).compile.enabled
    monkeypatch.setenv(COMPILE_DEFAULT_ENV, "maybe")
    with pytest.raises(ValueError, match=f"{COMPILE_DEFAULT_ENV}.*'maybe'"):
        load_config()


def test_tensor_parallel_runs_eager_and_says_why(monkeypatch, caplog):
    monkeypatch.delenv(COMPILE_DEFAULT_ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger="configs.schema"):
        config = load_config(overrides={"parallel.tensor_parallel_size": 2})
    assert config.compile.enabled and config.parallel.tensor_parallel_size == 2
    assert any("tensor_parallel_size=2" in r.getMessage() and "eager" in r.getMessage() for r in caplog.records)


def test_the_test_suite_runs_eager_unless_a_test_compiles():
    """tests/conftest.py turns the default off: a cold compile would cost every engine built
    with the default config minutes of CI."""
    assert not load_config().compile.enabled
