"""A drafter that scores a subset of the vocabulary (``spec.draft_vocab``): its drafts come
from the subset, greedy output equals plain decoding (eager and compiled chains, overlap on
and off), a sampled draft's distribution is zero outside the subset, and bad files are
refused with what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.workers.engine.helpers import make_llm, random_prompts
from workers.sampling.params import SamplingParams
from workers.spec.draft_vocab import FILE_NAME, DraftVocab, load_draft_vocab

P = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def with_vocab(model_dir: Path, out: Path, token_ids: list[int]) -> Path:
    shutil.copytree(model_dir, out)
    (out / FILE_NAME).write_text(json.dumps({"token_ids": token_ids}))
    return out


@pytest.fixture(scope="module")
def subset_model(tiny_qwen_dir, tmp_path_factory) -> tuple[Path, list[int]]:
    vocab = json.loads((tiny_qwen_dir / "config.json").read_text())["vocab_size"]
    subset = list(range(vocab - 1, 0, -3))  # a third of the tokens, not by id order
    return with_vocab(tiny_qwen_dir, tmp_path_factory.mktemp("draft-vocab") / "m", subset), subset


@pytest.fixture(scope="module")
def plain(tiny_qwen_dir):
    llm = make_llm(tiny_qwen_dir, cache={"enable_prefix_cache": False}, scheduler={"overlap": False})
    prompts = random_prompts(llm.engine.vocab_size, [3, 9, 17, 30, 6], seed=5)
    return prompts, [o.token_ids for o in llm.generate_ids(prompts, [P] * len(prompts))]


@pytest.mark.parametrize(
    "variant",
    [
        {"scheduler": {"overlap": False}},
        {"scheduler": {"overlap": True}},
        {"compile": {"enabled": True, "batch_sizes": [8]}},
    ],
)
def test_drafts_come_from_the_subset_and_greedy_output_is_unchanged(
    subset_model, plain, variant, compile_cache_dir, monkeypatch
):
    model, subset = subset_model
    prompts, expected = plain
    if "compile" in variant:
        variant = {"compile": {**variant["compile"], "cache_dir": str(compile_cache_dir)}}
    drafted: set[int] = set()
    tokens = DraftVocab.tokens

    def recorded(vocab, index):  # eager chains (a compiled one traces it)
        out = tokens(vocab, index)
        drafted.update(out.tolist())
        return out

    llm = make_llm(model, spec={"method": "mtp", "num_draft_tokens": 3}, debug={"check_invariants": True}, **variant)
    monkeypatch.setattr(DraftVocab, "tokens", recorded)
    drafter = llm.engine.drafter
    assert drafter.vocab.size == len(subset)
    assert [o.token_ids for o in llm.generate_ids(prompts, [P] * len(prompts))] == expected
    assert llm.stats()["hybridserve_spec_draft_tokens_total"] > 0
    registers = set(drafter.draft_tokens.unique().tolist()) - {0}  # 0: a register never written
    assert registers and registers <= set(subset)
    if "compile" in variant:
        assert sum(drafter.compiled_chain.num_verify_calls.values()) > 0
    else:
        assert drafted and drafted <= set(subset)


def test_the_subset_scores_its_rows_of_the_lm_head(subset_model, tiny_qwen_dir):
    model_dir, subset = subset_model
    llm = make_llm(tiny_qwen_dir)
    target = llm.engine.model
    vocab = load_draft_vocab("auto", model_dir, target)
    hidden = torch.randn(5, target.lm_head_weight().shape[1], generator=torch.Generator().manual_seed(0))
    full = target.compute_logits(hidden)
    ids = torch.tensor(subset)
    torch.testing.assert_close(vocab.logits(target, hidden), full[:, ids], rtol=1e-5, atol=1e-5)
    assert torch.equal(vocab.tokens(vocab.logits(target, hidden).argmax(-1)), ids[full[:, ids].argmax(-1)])
    probs = torch.softmax(vocab.logits(target, hidden), -1)
    spread = vocab.full(probs, full.shape[1])
    assert torch.equal(spread[:, ids], probs) and spread.sum() == spread[:, ids].sum()
    assert load_draft_vocab(None, model_dir, target).token_ids is None  # null: every token
    assert load_draft_vocab("auto", tiny_qwen_dir, target).token_ids is None  # no file: every token


def test_a_sampled_draft_is_drawn_from_the_subset(subset_model):
    model, subset = subset_model
    llm = make_llm(model, spec={"method": "mtp", "num_draft_tokens": 2})
    prompts = random_prompts(llm.engine.vocab_size, [7, 12], seed=2)
    seeded = SamplingParams(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True)
    llm.generate_ids(prompts, [seeded] * 2)  # drawn with the target's keyed noise, over the subset
    assert set(llm.engine.drafter.draft_tokens.flatten().tolist()) <= set(subset) | {0}
    llm.generate_ids(prompts, [SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)] * 2)
    probs = llm.engine.drafter.draft_probs  # unseeded: q kept for rejection sampling
    assert probs is not None
    used = probs.sum(-1) > 0
    outside = torch.ones(probs.shape[-1], dtype=torch.bool)
    outside[torch.tensor(subset)] = False
    torch.testing.assert_close(probs.sum(-1)[used], torch.ones(int(used.sum())))
    assert probs[..., outside].abs().sum() == 0


@pytest.mark.parametrize(
    "content,match",
    [
        ("not json", "not a JSON object"),
        ('{"ids": [1]}', "not a JSON object"),
        ('{"token_ids": []}', "non-empty list"),
        ('{"token_ids": [1, "2"]}', "non-empty list"),
        ('{"token_ids": [1, 99999]}', r"token ids \[99999\] outside the vocabulary"),
        ('{"token_ids": [4, 5, 4]}', "1 repeated token ids"),
    ],
)
def test_bad_files_are_refused(tiny_qwen_dir, tmp_path, content, match):
    path = tmp_path / "vocab.json"
    path.write_text(content)
    target = make_llm(tiny_qwen_dir).engine.model
    with pytest.raises(ValueError, match=match):
        load_draft_vocab(str(path), tiny_qwen_dir, target)
    with pytest.raises(ValueError, match="no file at"):
        load_draft_vocab(str(tmp_path / "missing.json"), tiny_qwen_dir, target)


def test_every_token_without_a_subset():
    vocab = DraftVocab()
    index = torch.tensor([3, 1])
    assert vocab.size is None and torch.equal(vocab.tokens(index), index)
