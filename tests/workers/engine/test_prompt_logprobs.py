"""Prompt logprobs from (chunked) prefill against transformers' log-softmax, and what a
prefix-cache hit or a preemption does to a request that asks for them."""

from __future__ import annotations

import pytest
import torch

from tests.workers.engine.helpers import make_llm, random_prompts
from tests.workers.models.hf_oracle import HFOracle
from workers.sampling.params import SamplingParams

LENGTHS = [2, 9, 23, 40, 14]
K = 3


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    prompts = random_prompts(512, LENGTHS, seed=12)
    oracle = HFOracle(tiny_model_dir)
    return prompts, [torch.log_softmax(oracle.logits(p), dim=-1) for p in prompts]


def check(out, prompt, ref):
    lps = out.prompt_logprobs
    assert len(lps) == len(prompt) and lps[0] is None
    for j in range(1, len(prompt)):
        e, row = lps[j], ref[j - 1]
        assert e.token_id == prompt[j]
        assert abs(e.logprob - float(row[prompt[j]])) <= 1e-4
        # the rank counts tokens above: ones within 1e-5 of it may fall either side here
        lp = row[prompt[j]]
        assert int((row > lp + 1e-5).sum()) + 1 <= e.rank <= int((row > lp - 1e-5).sum()) + 1
        top = torch.topk(row, K)
        assert [t for t, _ in e.top] == top.indices.tolist()
        assert max(abs(v - w) for (_, v), w in zip(e.top, top.values.tolist())) <= 1e-4


@pytest.mark.parametrize("overlap", [False, True])
def test_prompt_logprobs_equal_transformers_in_chunks(tiny_model_dir, reference, overlap):
    prompts, ref = reference
    llm = make_llm(tiny_model_dir, scheduler={"chunked_prefill_size": 8, "overlap": overlap})
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, prompt_logprobs=K, ignore_eos=True) for n in (0, 1, 3, 0, 2)
    ]
    outs = llm.generate_ids(prompts, params)
    for out, prompt, r, p in zip(outs, prompts, ref, params):
        check(out, prompt, r)
        assert len(out.token_ids) == p.max_tokens and out.finish_reason == "length"


def test_a_cache_hit_stops_where_the_logits_are_needed(tiny_qwen_dir):
    llm = make_llm(tiny_qwen_dir, scheduler={"chunked_prefill_size": 8})
    shared = random_prompts(512, [24], seed=13)[0]
    prompts = [shared + [5, 6, 7], shared + [8, 9]]
    oracle = HFOracle(tiny_qwen_dir)
    plain = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    asks = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=K)
    first = llm.generate_ids([prompts[0]], [plain])[0]
    assert first.cached_tokens == 0
    # The cache holds the shared prefix now; a request that needs its logits does not use it...
    out = llm.generate_ids([prompts[1]], [asks])[0]
    assert out.cached_tokens == 0
    check(out, prompts[1], torch.log_softmax(oracle.logits(prompts[1]), dim=-1))
    # ...while one that does not still hits it, and outputs are the same either way.
    again = llm.generate_ids([prompts[1]], [plain])[0]
    assert again.cached_tokens > 0 and again.token_ids == out.token_ids


def test_preempted_requests_keep_prompt_logprobs_and_penalties(tiny_model_dir, reference):
    prompts, ref = reference
    p = SamplingParams(
        max_tokens=12,
        temperature=0.0,
        ignore_eos=True,
        prompt_logprobs=K,
        repetition_penalty=1.3,
        frequency_penalty=0.8,
        logit_bias={17: 4.0, 18: 3.7},
    )
    roomy = make_llm(tiny_model_dir)
    expected = [o.token_ids for o in roomy.generate_ids(prompts * 2, [p] * 10)]
    tight = make_llm(tiny_model_dir, cache={"page_size": 4, "max_kv_tokens": 96}, scheduler={"chunked_prefill_size": 8})
    outs = tight.generate_ids(prompts * 2, [p] * 10)
    assert tight.stats()["hybridserve_preemptions_total"] > 0
    assert [o.token_ids for o in outs] == expected
    for out, prompt, r in zip(outs, prompts * 2, ref * 2):
        check(out, prompt, r)
