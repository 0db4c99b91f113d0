"""The sampling fields over HTTP (in-process replica, no Ray): echo and prompt
logprobs against transformers, every sampling field honoured or a 400 naming it, every
form of structured output, best_of."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
import torch

from cluster.api.http_api import make_api
from cluster.api.openai_server import OpenAIServer, ServerSettings
from cluster.serving.engine_client import LocalEngineClient
from cluster.serving.replica_core import ReplicaCore
from configs.schema import load_config
from tests.workers.models.hf_oracle import HFOracle

EOS = 0


@pytest.fixture(scope="module")
def env(tiny_qwen_dir):
    loop = asyncio.new_event_loop()
    config = load_config(
        overrides={
            "model": str(tiny_qwen_dir),
            "device": "cpu",
            "dtype": "float32",
            "cache": {"page_size": 4, "max_kv_tokens": 2048, "max_mamba_slots": 32},
            "scheduler": {"chunked_prefill_size": 8},
        }
    )
    core = loop.run_until_complete(ReplicaCore.create(config))
    server = OpenAIServer(
        LocalEngineClient(core), core.loop.engine.tokenizer, ServerSettings("tiny", str(tiny_qwen_dir))
    )
    yield loop, make_api(server), core.loop.engine.tokenizer
    loop.run_until_complete(core.shutdown())
    loop.close()


def post(env, path: str, body: dict) -> httpx.Response:
    loop, app, _ = env

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post(path, json=body, timeout=60)

    return loop.run_until_complete(go())


def ok(env, path: str, body: dict) -> dict:
    r = post(env, path, body)
    assert r.status_code == 200, r.text
    return r.json()


def chat(content: str = "hi") -> list[dict]:
    return [{"role": "user", "content": content}]


@pytest.mark.parametrize("max_tokens", [0, 1, 3])
def test_echo_logprobs_equal_transformers(env, tiny_qwen_dir, max_tokens):
    prompts = [[5, 9, 33, 71, 8, 200, 13, 44, 90, 17, 3], [100, 101, 7]]
    body = ok(
        env,
        "/v1/completions",
        {
            "prompt": prompts,
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": 2,
            "echo": True,
            "ignore_eos": True,
        },
    )
    oracle = HFOracle(tiny_qwen_dir)
    _, _, tok = env
    for prompt, choice in zip(prompts, body["choices"]):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(prompt) + max_tokens
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        ref = torch.log_softmax(oracle.logits(prompt), dim=-1)
        for j in range(1, len(prompt)):
            assert abs(lp["token_logprobs"][j] - float(ref[j - 1, prompt[j]])) <= 1e-4
            assert tok.decode([prompt[j]]) in lp["top_logprobs"][j]
            assert max(lp["top_logprobs"][j].values()) == pytest.approx(float(ref[j - 1].max()), abs=1e-4)
        assert choice["text"].startswith(tok.decode(prompt))
        assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    assert body["usage"]["completion_tokens"] == max_tokens * len(prompts)


def test_echo_streams_the_prompt_first(env):
    req = {"prompt": "the cat sat", "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 1, "ignore_eos": True}
    full = ok(env, "/v1/completions", req)["choices"][0]
    r = post(env, "/v1/completions", {**req, "stream": True})
    events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
    text = "".join(e["choices"][0]["text"] for e in events)
    offsets = [o for e in events if e["choices"][0]["logprobs"] for o in e["choices"][0]["logprobs"]["text_offset"]]
    assert text == full["text"] and offsets == full["logprobs"]["text_offset"]


def test_max_tokens_zero_needs_echo_or_prompt_logprobs(env):
    r = post(env, "/v1/completions", {"prompt": "x", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_vllm_prompt_logprobs_on_both_endpoints(env, tiny_qwen_dir):
    prompt = [5, 9, 33, 71, 8]
    body = ok(env, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 3})
    plp = body["choices"][0]["prompt_logprobs"]
    ref = torch.log_softmax(HFOracle(tiny_qwen_dir).logits(prompt), dim=-1)
    assert plp[0] is None and len(plp) == len(prompt)
    for j in range(1, len(prompt)):
        entry = plp[j][str(prompt[j])]
        assert abs(entry["logprob"] - float(ref[j - 1, prompt[j]])) <= 1e-4
        assert entry["rank"] == int((ref[j - 1] > ref[j - 1, prompt[j]]).sum()) + 1
        assert len(plp[j]) in (3, 4)  # the prompt token and the top 3
    chat_body = ok(env, "/v1/chat/completions", {"messages": chat(), "max_tokens": 1, "prompt_logprobs": 0})
    assert chat_body["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat_body["prompt_logprobs"][1:])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_logit_bias_and_penalties_are_honoured(env, path):
    base = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    base.update({"prompt": [5, 6, 7]} if path.endswith("completions") and "chat" not in path else {"messages": chat()})
    forced = ok(env, path, {**base, "logit_bias": {"77": 100}})
    assert forced["choices"][0]["token_ids"] == [77] * 6
    plain = ok(env, path, {**base, "logit_bias": {"77": 5}})["choices"][0]["token_ids"]
    penalised = ok(
        env,
        path,
        {**base, "logit_bias": {"77": 5}, "frequency_penalty": 2.0, "presence_penalty": 2.0, "repetition_penalty": 1.5},
    )["choices"][0]["token_ids"]
    assert plain.count(77) > penalised.count(77) >= 1


@pytest.mark.parametrize(
    "field,value",
    [
        ("repetition_penalty", 0),
        ("repetition_penalty", -1),
        ("min_p", 2),
        ("min_p", -0.1),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("logit_bias", {"5": 101}),
        ("logit_bias", {"abc": 1}),
        ("logit_bias", {"999999": 1}),
        ("best_of", 0),
        ("prompt_logprobs", 21),
        ("bad_words", [""]),
        ("guided_whitespace_pattern", r"\s*"),
        ("guided_decoding_backend", "outlines"),
        ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}),
        ("structured_outputs", {"regex": "(ab"}),
        ("structured_outputs", {"regex": "a", "choice": ["b"]}),
        ("guided_grammar", "root ::= missing"),
        ("guided_choice", []),
    ],
)
def test_bad_values_are_400s_naming_the_field(env, field, value):
    for path, extra in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": chat()})):
        r = post(env, path, {**extra, "max_tokens": 2, field: value})
        assert r.status_code == 400, (path, field, r.text)
        assert r.json()["error"]["param"].startswith(field), r.json()


def test_two_constraints_are_refused(env):
    r = post(
        env,
        "/v1/chat/completions",
        {"messages": chat(), "guided_regex": "a+", "response_format": {"type": "json_object"}},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] in ("guided_regex", "response_format")


PET = {
    "type": "object",
    "properties": {"kind": {"enum": ["cat", "dog"]}, "age": {"type": "integer", "minimum": 0, "maximum": 20}},
    "required": ["kind", "age"],
    "additionalProperties": False,
}
FORMS = {
    "response_format json_schema": (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}}},
        lambda t: json.loads(t)["kind"] in ("cat", "dog"),
    ),
    "structured_outputs json": (
        {"structured_outputs": {"json": PET, "disable_any_whitespace": True}},
        lambda t: set(json.loads(t)) == {"kind", "age"},
    ),
    "structured_outputs regex": (
        {"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}},
        lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t),
    ),
    "structured_outputs choice": ({"structured_outputs": {"choice": ["red", "blue"]}}, lambda t: t in ("red", "blue")),
    "structured_outputs grammar": (
        {"structured_outputs": {"grammar": 'root ::= "x" [0-9]+ "y"'}},
        lambda t: re.fullmatch("x[0-9]+y", t),
    ),
    "guided_json": ({"guided_json": PET}, lambda t: json.loads(t)["age"] <= 20),
    "guided_regex": ({"guided_regex": "[a-c]{4}"}, lambda t: re.fullmatch("[a-c]{4}", t)),
    "guided_choice": ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    "guided_grammar": ({"guided_grammar": 'root ::= ("ab" | "cd")+ "."'}, lambda t: re.fullmatch("(ab|cd)+[.]", t)),
    "response_format structural_tag": (
        {
            "response_format": {
                "type": "structural_tag",
                "format": {
                    "type": "tag",
                    "begin": "<p>",
                    "end": "</p>",
                    "content": {"type": "json_schema", "json_schema": PET},
                },
            }
        },
        lambda t: t.startswith("<p>") and t.endswith("</p>") and json.loads(t[3:-4])["kind"] in ("cat", "dog"),
    ),
}


@pytest.mark.parametrize("form", list(FORMS))
def test_every_structured_output_form(env, form):
    fields, valid = FORMS[form]
    for path, extra in (("/v1/completions", {"prompt": "hello"}), ("/v1/chat/completions", {"messages": chat()})):
        # a seed whose draws close every form within max_tokens: the random model may wander in
        # a grammar's whitespace (seed 3 does on chat + structural_tag since draws are keyed by position)
        body = ok(env, path, {**extra, "max_tokens": 80, "temperature": 0.8, "seed": 4, **fields})
        choice = body["choices"][0]
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        assert choice["finish_reason"] == "stop" and valid(text), (path, text)


def test_json_object_response_format_starts_an_object(env):
    body = ok(
        env,
        "/v1/chat/completions",
        {"messages": chat(), "max_tokens": 40, "temperature": 0, "response_format": {"type": "json_object"}},
    )
    assert body["choices"][0]["message"]["content"].lstrip().startswith("{")


def test_best_of_returns_the_most_likely_of_its_sequences(env):
    req = {
        "prompt": [5, 6, 7, 8],
        "max_tokens": 6,
        "temperature": 1.2,
        "seed": 40,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    every = ok(env, "/v1/completions", {**req, "n": 4, "logprobs": 0})["choices"]
    sums = [sum(c["logprobs"]["token_logprobs"]) for c in every]
    best = ok(env, "/v1/completions", {**req, "n": 2, "best_of": 4})["choices"]
    ranked = sorted(range(4), key=lambda j: sums[j], reverse=True)
    assert [c["token_ids"] for c in best] == [every[j]["token_ids"] for j in ranked[:2]]
    assert [c["index"] for c in best] == [0, 1]
    for bad in ({"n": 3, "best_of": 2}, {"best_of": 3, "stream": True}):
        r = post(env, "/v1/completions", {**req, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"


def test_stop_string_kept_and_special_tokens_shown(env):
    base = {"prompt": [5, 6, 7], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    text = ok(env, "/v1/completions", base)["choices"][0]["text"]
    stop = text[4:6]
    kept = ok(env, "/v1/completions", {**base, "stop": [stop], "include_stop_str_in_output": True})["choices"][0]
    assert kept["text"] == text[: text.index(stop) + len(stop)] and kept["stop_reason"] == stop
    eos = {**base, "max_tokens": 2, "logit_bias": {str(EOS): 100}}
    assert ok(env, "/v1/completions", eos)["choices"][0]["text"] == ""
    shown = ok(env, "/v1/completions", {**eos, "skip_special_tokens": False})["choices"][0]["text"]
    assert shown == "<|endoftext|>" * 2


def test_min_tokens_holds_eos_back(env):
    body = ok(
        env,
        "/v1/chat/completions",
        {
            "messages": chat(),
            "max_tokens": 8,
            "temperature": 0,
            "min_tokens": 5,
            "logit_bias": {str(EOS): 100},
            "return_token_ids": True,
        },
    )
    ids = body["choices"][0]["token_ids"]
    assert len(ids) == 6 and EOS not in ids[:5] and ids[5] == EOS
    assert body["usage"]["completion_tokens"] == 6


def test_run_batch_best_of_and_echo(tiny_qwen_dir):
    from cluster.api.run_batch import run_batch
    from tests.workers.engine.helpers import make_llm

    llm = make_llm(tiny_qwen_dir)
    req = {
        "prompt": [5, 6, 7, 8],
        "max_tokens": 5,
        "temperature": 1.2,
        "seed": 9,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    lines = [
        json.dumps({"custom_id": cid, "url": "/v1/completions", "body": {**req, **extra}})
        for cid, extra in (
            ("all", {"n": 3, "logprobs": 0}),
            ("best", {"best_of": 3}),
            ("echo", {"max_tokens": 0, "echo": True, "logprobs": 1}),
        )
    ]
    out = {r["custom_id"]: r["response"]["body"]["choices"] for r in run_batch(llm, lines, "m")}
    sums = [sum(c["logprobs"]["token_logprobs"]) for c in out["all"]]
    best = max(range(3), key=sums.__getitem__)
    assert [c["token_ids"] for c in out["best"]] == [out["all"][best]["token_ids"]]
    echo = out["echo"][0]
    assert echo["text"] == llm.tokenizer.decode([5, 6, 7, 8])
    assert echo["logprobs"]["token_logprobs"][0] is None
    assert len(echo["logprobs"]["tokens"]) == 4


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_min_p_and_bad_words_are_honoured(env, path):
    base = {"max_tokens": 8, "ignore_eos": True, "return_token_ids": True, "seed": 4}
    base.update({"prompt": [5, 6, 7, 9]} if "chat" not in path else {"messages": chat()})
    greedy = ok(env, path, {**base, "temperature": 0})["choices"][0]["token_ids"]
    top_only = ok(env, path, {**base, "temperature": 1.5, "min_p": 1.0})["choices"][0]["token_ids"]
    assert top_only == greedy
    _, _, tok = env
    banned = greedy[2]
    sampled = ok(env, path, {**base, "temperature": 1.0, "bad_words": [tok.decode([banned])]})["choices"][0]
    assert banned not in sampled["token_ids"]
