"""The LLM API's contract: stops, limits, seeds, logprobs, bad input, no leaks."""

from __future__ import annotations

import pytest

from tests.workers.engine.helpers import assert_no_leaks, make_llm, random_prompts
from workers.sampling.params import SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_qwen_dir):
    return make_llm(tiny_qwen_dir)


def test_output_fields_and_text(llm):
    out = llm.generate("def f(x):", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert out.prompt == "def f(x):"
    assert out.prompt_token_ids == llm.encode("def f(x):")
    assert len(out.token_ids) == 12 and out.finish_reason == "length"
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert out.cached_tokens == 0
    assert_no_leaks(llm)


def test_stop_string_cuts_text(llm):
    base = llm.generate("x = ", SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    assert len(base.text) > 6
    stop = base.text[3:6]
    out = llm.generate("x = ", SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[: base.text.index(stop)]
    assert out.token_ids == base.token_ids[: len(out.token_ids)]


def test_stop_token_ids_and_eos(llm):
    base = llm.generate([5, 6, 7], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    stop_tok = base.token_ids[4]
    first = base.token_ids.index(stop_tok)
    out = llm.generate([5, 6, 7], SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[stop_tok]))[0]
    assert out.token_ids == base.token_ids[: first + 1] and out.finish_reason == "stop"


def test_seeded_sampling_reproducible(llm):
    prompts = random_prompts(llm.engine.vocab_size, [6, 11, 4])
    p = SamplingParams(max_tokens=16, temperature=1.0, seed=42, ignore_eos=True)
    a = [o.token_ids for o in llm.generate(prompts, p)]
    b = [o.token_ids for o in llm.generate(list(reversed(prompts)), p)]
    assert a == list(reversed(b))
    unseeded = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True))
    assert [o.token_ids for o in unseeded] != a


def test_top_k_one_equals_greedy(llm):
    prompts = random_prompts(llm.engine.vocab_size, [9, 14])
    greedy = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    topk1 = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=1.5, top_k=1, ignore_eos=True))
    assert [o.token_ids for o in greedy] == [o.token_ids for o in topk1]


def test_logprobs(llm):
    out = llm.generate([4, 5, 6], SamplingParams(max_tokens=5, temperature=0, logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok and len(lp.top) == 3
        assert lp.top[0][0] == tok and lp.logprob == pytest.approx(lp.top[0][1]) and lp.logprob <= 0


@pytest.mark.parametrize(
    "prompt,match",
    [
        ([], "at least one token"),
        ([10**9], "outside the vocabulary"),
        ([-1], "outside the vocabulary"),
        ([True, False, True], r"must be a list of ints, got \[True, False, True\]"),
        ([5, 6.0], "list of ints"),
    ],
)
def test_bad_prompts_raise_and_leak_nothing(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([[1, 2, 3], prompt], SamplingParams(max_tokens=4))
    assert_no_leaks(llm)


def test_engine_refuses_non_int_token_ids(llm):
    with pytest.raises(ValueError, match=r"must be ints, got \[True\]"):
        llm.engine.add_request("bools", [5, True], SamplingParams(max_tokens=2))
    assert_no_leaks(llm)


def test_prompt_too_long(llm):
    n = llm.engine.max_model_len
    with pytest.raises(ValueError, match=f"{n}"):
        llm.generate([[5] * n], SamplingParams(max_tokens=4))
    assert_no_leaks(llm)


def test_abort_frees_everything(llm):
    from workers.sampling.params import SamplingParams as SP

    e = llm.engine
    llm.add_request("a", [5] * 20, SP(max_tokens=50, ignore_eos=True))
    llm.add_request("b", [6] * 20, SP(max_tokens=50, ignore_eos=True))
    llm.step()
    llm.step()
    out = llm.abort("a")
    assert out.finished and out.finish_reason == "abort"
    assert llm.abort("a") is None
    llm.abort("b")
    while e.has_unfinished():  # an in-flight batch finishes the deferred release
        assert e.step() == []
    assert_no_leaks(llm)


def test_stats_keys(llm):
    stats = llm.stats()
    assert stats["hybridserve_requests_total"].get("length", 0) > 0
    assert stats["hybridserve_time_to_first_token_seconds"]["count"] > 0
    for key in (
        "hybridserve_preemptions_total",
        "hybridserve_num_running_requests",
        "hybridserve_kv_pool_usage_ratio",
        "hybridserve_step_gap_seconds",
    ):
        assert key in stats
