"""Qwen4-Exp beyond the registry suite: prompts with EOS inside (the n-gram context is cut at
an EOS, and the id window carries it across chunks), the indexer really selecting a subset
of the context in the tiny checkpoint, and the config fields refused by name."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.workers.models.harness import Harness, random_prompts
from tests.workers.models.hf_oracle import HFOracle
from tools.tiny import make_tiny_checkpoint, tiny_config
from workers.loader import load_model
from workers.models import qwen4_exp_layers
from workers.models.qwen4_exp import Qwen4ExpForCausalLM

TOL = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_checkpoint("qwen4_exp", tmp_path_factory.mktemp("qwen4_exp"))


def eos_prompts(vocab: int, eos: int) -> list[list[int]]:
    prompts = random_prompts(vocab, [9, 30, 41], seed=5)
    prompts[0][3] = eos  # cuts the context of tokens 4 and 5
    prompts[1][12] = prompts[1][13] = eos
    prompts[1][-1] = eos  # the last token: the next chunk starts after an EOS
    prompts[2][0] = eos
    return prompts


def test_eos_cut_matches_transformers_in_any_chunking(checkpoint) -> None:
    model = load_model(checkpoint, torch.float32, "cpu").model
    oracle = HFOracle(checkpoint)
    eos = model.config.eos_token_id
    prompts = eos_prompts(model.config.vocab_size, eos)
    tail = [7, eos, 11, 12]  # decoded one token at a time after the prompt
    harness = Harness(model)
    plans = [[4, 1, 4], [13, 1, 16], [1, 40]]
    got: list[list[torch.Tensor]] = [[] for _ in prompts]
    for step in range(3):
        chunks = [(i, p[sum(plan[:step]) : sum(plan[: step + 1])]) for i, (p, plan) in enumerate(zip(prompts, plans))]
        for (i, _), logits in zip(chunks, harness.step(chunks)):
            got[i].append(logits)
    for token in tail:
        for i, logits in enumerate(harness.decode([token] * len(prompts))):
            got[i].append(logits[None])
    for i, prompt in enumerate(prompts):
        ref = oracle.logits(prompt + tail)
        assert (torch.cat(got[i]) - ref).abs().max().item() <= TOL, f"prompt {i}"


def test_indexer_selects_a_subset_of_long_contexts(checkpoint, monkeypatch) -> None:
    """Otherwise the registry suite's chunking and prefix-cache tests would prove nothing."""
    model = load_model(checkpoint, torch.float32, "cpu").model
    selections: list[torch.Tensor] = []
    select = qwen4_exp_layers.QsaIndexer.forward

    def spy(self, x, ctx, ref):
        out = select(self, x, ctx, ref)
        selections.append(out)
        return out

    monkeypatch.setattr(qwen4_exp_layers.QsaIndexer, "forward", spy)
    Harness(model).prefill(random_prompts(model.config.vocab_size, [70], seed=1))
    assert len(selections) == 2  # the two indexed attention layers
    for positions in selections:
        kept = (positions >= 0).sum(1)
        assert kept[:8].tolist() == list(range(1, 9))  # short prefixes: every position
        assert kept.max().item() <= 11 and kept[-1].item() == 10  # 2 blocks of 4 + the tail
        late = positions[40:]
        assert (late[late >= 0] < 32).any()  # old blocks too, not just the recent ones


REFUSED = {
    "output_gate_type": ({"output_gate_type": "sigmoid"}, "output_gate_type='sigmoid'"),
    "hidden_act": ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    "layer_types": (
        {"layer_types": ["linear_attention", "sliding_attention"] + ["linear_attention"] * 3},
        "layer_types",
    ),
    "indexer_kv_heads": ({"indexer_kv_heads": 2}, "indexer_kv_heads=2"),
    "indexer_budget": ({"indexer_budget": 6}, "indexer_budget=6"),
    "indexer_missing": ({"indexer_head_dim": None}, "indexer_head_dim=None"),
    "hc_count": ({"hc_count": 1}, "hc_count=1"),
    "ple_on_attention": ({"ple_layer_ids": [2]}, "ple_layer_ids=[2]"),
    "ple_eos": ({"eos_token_id": None}, "eos_token_id=None"),
    "ple_embed_dim": ({"ple_embed_dim": 30}, "ple_embed_dim=30"),
    "rope_type": ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "rope_type"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_fields_are_named(case: str) -> None:
    changes, named = REFUSED[case]
    cfg = SimpleNamespace(**{**tiny_config("qwen4_exp", 512, 2).to_dict(), **changes})
    with pytest.raises(ValueError, match=re.escape(named)):
        Qwen4ExpForCausalLM.validate_config(cfg)
