"""A request given its first outputs (``output_prefix``: a prefill/decode hand-off) goes on
exactly as the undisturbed run: same tokens and text for greedy, seeded sampling with
penalties (which count output tokens), a grammar (which must have accepted them) and stop
strings with ``min_tokens`` (held-back text comes out with what follows), with and without
overlap and MTP; what cannot go on is refused with the values named."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.workers.engine.helpers import assert_no_leaks, make_llm, random_prompts
from workers.output_processor import HANDOFF, OutputProcessor
from workers.outputs import EngineOutput
from workers.sampling.params import SamplingParams
from workers.sampling.structured import StructuredOutput

N = 10
SPEC = {"method": "mtp", "num_draft_tokens": 3}
VARIANTS = {"plain": {"scheduler": {"overlap": False}}, "spec_overlap": {"scheduler": {"overlap": True}, "spec": SPEC}}
PARAMS = {
    "greedy": SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=N, temperature=1.0, seed=5, ignore_eos=True),
    # negative: the tokens already output win, so the prefix's count decides the next ones
    "penalties": SamplingParams(max_tokens=N, temperature=0.0, presence_penalty=-2.0, frequency_penalty=-1.0),
    "grammar": SamplingParams(max_tokens=N, temperature=1.0, seed=3, structured_output=StructuredOutput.json_object()),
}


def _undisturbed(llm, prompts, params):
    return llm.generate_ids(prompts, [params] * len(prompts))


def _resumed(llm, prompts, params, outs, k):
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        llm.add_request(f"r{k}-{i}", prompt, params, out.token_ids[:k])
    done = {}
    while len(done) < len(prompts):
        done.update({o.request_id: o for o in llm.step()})
    return [done[f"r{k}-{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_output_prefix_continues_the_undisturbed_run(tiny_qwen_dir, variant):
    llm = make_llm(tiny_qwen_dir, **VARIANTS[variant])
    prompts = random_prompts(512, [7, 20, 3], seed=8)
    for name, params in PARAMS.items():
        expected = _undisturbed(llm, prompts, params)
        for k in (1, 4):
            live = [i for i, o in enumerate(expected) if len(o.token_ids) > k]  # those that went on
            got = _resumed(llm, [prompts[i] for i in live], params, [expected[i] for i in live], k)
            assert [o.token_ids for o in got] == [expected[i].token_ids for i in live], (name, k)
            assert [o.text for o in got] == [expected[i].text for i in live], (name, k)
    assert_no_leaks(llm)


def _stream(processor, rid, tokens, last_reason="length"):
    """Feed ``tokens`` one output at a time; the deltas' text and the last finish reason."""
    text, reason = "", None
    for n, t in enumerate(tokens):
        last = n == len(tokens) - 1
        out = EngineOutput(rid, [t], None, last, last_reason if last else None, None, 0, None)
        (delta,) = processor.process([out]).deltas
        text, reason = text + delta.delta_text, delta.finish_reason
    return text, reason


def test_handoff_sends_each_character_once(tiny_qwen_dir):
    """A prefill replica's first token (``handoff``: its finish by length flushes nothing)
    and the decode replica's rest (``output_prefix``) stream the undisturbed text, also
    when the first token's text may start a stop string (held back, sent once later)."""
    llm = make_llm(tiny_qwen_dir, scheduler={"overlap": False})
    prompt = random_prompts(512, [9], seed=2)[0]
    tokens = _undisturbed(llm, [prompt], SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True))[0].token_ids
    first_text = llm.tokenizer.decode(tokens[:1])
    for stop in [(), (first_text[-1:] + "\x00",), (first_text + "\x00",)]:
        params = SamplingParams(max_tokens=N, temperature=0.0, stop=stop)
        whole = OutputProcessor(llm.tokenizer)
        whole.add("w", prompt, params)
        expected, _ = _stream(whole, "w", tokens)
        prefill, decode = OutputProcessor(llm.tokenizer), OutputProcessor(llm.tokenizer)
        prefill.add("p", prompt, params, handoff=True)
        head, reason = _stream(prefill, "p", tokens[:1])
        decode.add("d", prompt, params, tokens[:1])
        tail, _ = _stream(decode, "d", tokens[1:])
        assert reason == HANDOFF and head + tail == expected, stop


def test_output_prefix_refusals_name_the_values(tiny_qwen_dir):
    llm = make_llm(tiny_qwen_dir, scheduler={"overlap": False})
    params = SamplingParams(max_tokens=3, temperature=0.0)
    with pytest.raises(ValueError, match="leaves nothing of max_tokens=3"):
        llm.add_request("a", [1, 2, 3], params, [4, 5, 6])
    with pytest.raises(ValueError, match=r"outside the vocabulary"):
        llm.add_request("b", [1, 2, 3], params, [10**9])
    with pytest.raises(ValueError, match="is EOS or a stop token"):
        llm.add_request("d", [1, 2, 3], replace(params, stop_token_ids=(9,)), [9])
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.add_request("c", [1, 2, 3], replace(params, prompt_logprobs=1), [4])
    assert not llm.engine.has_unfinished()
    assert_no_leaks(llm)
