"""The tiny default-model run that the training tests share: ``TINY_SHAPE``, the settings of
a few-step run, and ``trained`` (its output dir and info, built once per module)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.training import train_default as td

TINY_SHAPE = dict(
    hidden_size=32,
    num_blocks=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    linear_num_key_heads=1,
    linear_num_value_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    intermediate_size=48,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
)


def tiny_settings(**kw) -> td.TrainSettings:
    base = dict(
        seq_len=32,
        batch_size=2,
        steps=3,
        minutes=2.0,
        warmup_steps=2,
        eval_windows=4,
        tokenizer_vocab=300,
        save_dtype="float32",
        shape=td.ModelShape(**TINY_SHAPE),
    )
    return td.TrainSettings(**{**base, **kw})


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("default_model")
    info = td.run(out, tiny_settings(), "test", log=lambda *a: None, max_files=12, sample_tokens=5)
    return out, info
