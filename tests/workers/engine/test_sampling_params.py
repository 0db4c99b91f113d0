"""Sampling parameters end to end: the engine against transformers' ``generate`` with the
same processors, and the same outputs under every variant (overlap, speculation with
drafts accepted at every length, prefix cache, chunked prefill)."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList

from tests.workers.engine.helpers import OracleDrafts, make_llm, random_prompts
from workers.sampling.params import SamplingParams
from workers.sampling.requests import bad_words_token_ids

EOS = 0
N = 14


class FrequencyPresence(LogitsProcessor):
    """OpenAI's frequency / presence penalties over the generated tokens (not in transformers)."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores)
        out = input_ids[:, self.prompt_len :]
        counts.scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def hf_generate(model_dir, prompts, p: SamplingParams, bad_words):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=p.max_tokens,
                do_sample=False,
                eos_token_id=EOS,
                pad_token_id=EOS,
                repetition_penalty=p.repetition_penalty,
                bad_words_ids=[list(w) for w in bad_words],
                min_new_tokens=p.min_tokens,
                sequence_bias=[[[t], b] for t, b in p.logit_bias],
                logits_processor=LogitsProcessorList(
                    [FrequencyPresence(len(prompt), p.frequency_penalty, p.presence_penalty)]
                ),
            )
            outs.append(gen[0, len(prompt) :].tolist())
    return outs


def penalised(bad_word: str | None = None) -> SamplingParams:
    # EOS is pushed up so that min_tokens decides where the output ends; 17, 18, 19 are
    # pushed up in that order, so that only the penalties on the ones already generated
    # (drafts of a verify included) make the next one win: outputs start 17 18 19.
    return SamplingParams(
        max_tokens=N,
        temperature=0.0,
        repetition_penalty=1.1,
        frequency_penalty=0.3,
        presence_penalty=2.0,
        logit_bias={EOS: 6.0, 17: 5.0, 18: 4.6, 19: 4.2},
        min_tokens=9,
        bad_words=(bad_word,) if bad_word else (),
    )


@pytest.fixture(scope="module")
def case(tiny_qwen_dir):
    """Prompts, params and transformers' outputs; one bad word taken from a plain run."""
    llm = make_llm(tiny_qwen_dir)
    prompts = random_prompts(llm.engine.vocab_size, [4, 11, 19, 7, 26], seed=5)
    prompts.append(prompts[2][:16] + [33, 34])  # shares a cached prefix
    plain = llm.generate_ids(prompts, [penalised()] * len(prompts))
    word = llm.tokenizer.decode(plain[1].token_ids[2:4])
    bad = bad_words_token_ids((word,), llm.tokenizer)
    params = penalised(word)
    expected = hf_generate(tiny_qwen_dir, prompts, params, bad)
    return prompts, params, expected


def test_greedy_with_penalties_bias_bad_words_min_tokens_equals_transformers(tiny_qwen_dir, case):
    prompts, params, expected = case
    llm = make_llm(tiny_qwen_dir, scheduler={"chunked_prefill_size": 8})
    outs = llm.generate_ids(prompts, [params] * len(prompts))
    assert [o.token_ids for o in outs] == expected
    assert all(len(t) >= 10 and t[-1] == EOS for t in expected[:3])  # min_tokens reached, then EOS
    assert all(EOS not in o.token_ids[:9] for o in outs)
    assert all(o.finish_reason == "stop" for o in outs if o.token_ids[-1] == EOS)


@pytest.fixture
def oracle(monkeypatch):
    """Verifies accept 0..k drafts, so the processors run at every draft position."""
    return OracleDrafts(monkeypatch, lambda d: (d + 1) % 64)


@pytest.mark.parametrize("overlap", [False, True])
def test_penalties_identical_under_speculation_and_overlap(tiny_qwen_dir, case, oracle, overlap):
    prompts, params, expected = case
    llm = make_llm(
        tiny_qwen_dir,
        scheduler={"overlap": overlap, "chunked_prefill_size": 8},
        spec={"method": "mtp", "num_draft_tokens": 3},
        debug={"check_invariants": True},
    )
    llm.engine.raise_on_violation = True
    oracle.expect(llm.engine, prompts, expected)
    for _ in range(2):  # the second pass hits the cache
        assert [o.token_ids for o in llm.generate_ids(prompts, [params] * len(prompts))] == expected
    stats = llm.stats()
    assert stats["hybridserve_spec_accepted_tokens_total"] > 10
    assert stats["hybridserve_prefix_hit_tokens_total"] > 0


def test_logit_bias_plus_100_forces_the_token(tiny_qwen_dir):
    llm = make_llm(tiny_qwen_dir, scheduler={"overlap": True})
    prompts = random_prompts(llm.engine.vocab_size, [5, 9], seed=8)
    for temperature in (0.0, 1.0):
        p = SamplingParams(max_tokens=6, temperature=temperature, seed=1, logit_bias={77: 100.0})
        assert [o.token_ids for o in llm.generate_ids(prompts, [p] * 2)] == [[77] * 6] * 2


def test_min_tokens_blocks_eos_instead_of_hiding_it(tiny_qwen_dir):
    llm = make_llm(tiny_qwen_dir)
    p = SamplingParams(max_tokens=10, temperature=0.0, logit_bias={EOS: 100.0}, min_tokens=4)
    out = llm.generate_ids([[5, 6, 7]], [p])[0]
    assert out.token_ids[:4] != [EOS] * 4 and EOS not in out.token_ids[:4]
    assert out.token_ids[4:] == [EOS] and out.finish_reason == "stop"
    stop = SamplingParams(max_tokens=10, temperature=0.0, logit_bias={9: 100.0}, stop_token_ids=[9], min_tokens=3)
    out = llm.generate_ids([[5, 6, 7]], [stop])[0]
    assert len(out.token_ids) == 4 and out.token_ids[-1] == 9 and 9 not in out.token_ids[:3]


def test_min_p_one_is_greedy_and_bad_words_never_appear(tiny_qwen_dir):
    llm = make_llm(tiny_qwen_dir)
    prompts = random_prompts(llm.engine.vocab_size, [6, 13], seed=9)
    greedy = llm.generate_ids(prompts, [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)] * 2)
    top_only = SamplingParams(max_tokens=10, temperature=1.5, min_p=1.0, seed=4, ignore_eos=True)
    assert [o.token_ids for o in llm.generate_ids(prompts, [top_only] * 2)] == [o.token_ids for o in greedy]
    banned = greedy[0].token_ids[3]
    p = SamplingParams(
        max_tokens=10, temperature=1.0, seed=2, ignore_eos=True, bad_words=(llm.tokenizer.decode([banned]),)
    )
    for out in llm.generate_ids(prompts, [p] * 2):
        assert banned not in out.token_ids


def test_skip_special_tokens_and_include_stop_str(tiny_qwen_dir):
    llm = make_llm(tiny_qwen_dir)
    p = dict(max_tokens=3, temperature=0.0, ignore_eos=True, logit_bias={EOS: 100.0})
    hidden = llm.generate([[5, 6]], SamplingParams(**p))[0]
    shown = llm.generate([[5, 6]], SamplingParams(**p, skip_special_tokens=False))[0]
    assert hidden.token_ids == shown.token_ids == [EOS] * 3
    assert hidden.text == "" and shown.text == "<|endoftext|>" * 3
    base = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    stop = base.text[4:6]
    cut = llm.generate(
        [[5, 6, 7]],
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
    )[0]
    assert cut.text == base.text[: base.text.index(stop) + len(stop)]


def test_seeded_sampling_with_processors_identical_with_overlap(tiny_qwen_dir):
    prompts = random_prompts(512, [5, 12, 8], seed=4)
    p = SamplingParams(
        max_tokens=12,
        temperature=0.9,
        top_p=0.9,
        min_p=0.02,
        seed=11,
        repetition_penalty=1.2,
        frequency_penalty=0.5,
        logit_bias={3: 2.0},
        ignore_eos=True,
    )
    runs = []
    for overlap in (False, True):
        llm = make_llm(tiny_qwen_dir, scheduler={"overlap": overlap})
        runs.append([o.token_ids for o in llm.generate_ids(prompts, [p] * 3)])
    assert runs[0] == runs[1]


def test_best_of_keeps_the_most_likely_sequence(tiny_qwen_dir):
    llm = make_llm(tiny_qwen_dir)
    prompt = [5, 6, 7, 8]
    one = dict(max_tokens=8, temperature=1.2, ignore_eos=True)
    singles = [llm.generate_ids([prompt], [SamplingParams(**one, seed=40 + j, logprobs=0)])[0] for j in range(4)]
    sums = [sum(lp.logprob for lp in o.logprobs) for o in singles]
    assert len(set(sums)) == 4  # the candidates differ
    best = llm.generate_ids([prompt], [SamplingParams(**one, seed=40, best_of=4)])[0]
    winner = max(range(4), key=lambda j: sums[j])
    assert best.token_ids == singles[winner].token_ids
    assert best.cumulative_logprob == pytest.approx(sums[winner], abs=1e-4)
