"""The tokenizer and service endpoints, and the issue-15 bug list, over HTTP in process (no Ray)."""

from __future__ import annotations

import time

import pytest

from cluster.api.openai_service import prepare_completion
from cluster.api.protocol import validate_completion
from tests.cluster.api.conftest import sse_objects
from tests.cluster.api.scripted_model import HERMES_ANSWER

KEY = "sk-endpoints"
USER = [{"role": "user", "content": "hello there"}]
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def app(local_app, tiny_qwen_dir):
    return local_app(tiny_qwen_dir, "tiny", api_key=KEY)


@pytest.fixture(scope="module")
def scripted(local_app, scripted_hermes_dir):
    return local_app(scripted_hermes_dir, "scripted")


def test_tokenize_and_detokenize_round_trip(app):
    tok = app.server.tokenizer
    body = app.call("POST", "/tokenize", json={"prompt": "the cat sat", "return_token_strs": True}).json()
    assert body["tokens"] == tok.encode("the cat sat", add_special_tokens=True)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
    assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
    assert app.call("POST", "/tokenize", json={"prompt": "x"}).json()["token_strs"] is None
    assert app.call("POST", "/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": "the cat sat"}
    r = app.call("POST", "/detokenize", json={"tokens": [10**7]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = app.call("POST", "/tokenize", json={"prompt": "x", "model": "other"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_tokenize_messages_is_the_chat_prompt(app):
    ids = app.call("POST", "/tokenize", json={"messages": USER}).json()["tokens"]
    chat = app.call(
        "POST", "/v1/chat/completions", json={"messages": USER, "max_tokens": 1, "return_token_ids": True}
    ).json()
    assert chat["prompt_token_ids"] == ids
    bare = app.call("POST", "/tokenize", json={"messages": USER, "add_generation_prompt": False}).json()["tokens"]
    assert ids[: len(bare)] == bare and len(ids) > len(bare)


def test_tokenizer_info_version_ping_and_model_card(app):
    info = app.call("GET", "/tokenizer_info").json()
    assert info["tokenizer_class"] and info["chat_template"] == app.server.tokenizer.chat_template
    assert info["eos_token"] == "<|endoftext|>"
    assert app.call("GET", "/version").json()["version"]
    for method in ("GET", "POST"):
        assert app.call(method, "/ping", headers={}).status_code == 200  # no key, as /health
    card = app.call("GET", "/v1/models/tiny").json()
    assert card["id"] == "tiny" and card["object"] == "model"
    assert abs(card["created"] - time.time()) < 3600  # a real timestamp
    assert app.call("GET", "/v1/models").json()["data"][0] == card
    r = app.call("GET", "/v1/models/other")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert app.call("GET", "/version", headers={}).status_code == 401  # the key guards the rest


def test_metrics_on_the_api_port(app):
    app.call("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    r = app.call("GET", "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert 'hybridserve_requests_total{finish_reason="length",model="tiny",replica="local"}' in r.text
    assert "hybridserve_time_to_first_token_seconds_bucket" in r.text


def test_completions_default_to_the_rest_of_the_context():
    class Tok:
        def encode(self, text, add_special_tokens=True):
            return [1, 2, 3]

    prepared = prepare_completion(validate_completion({"prompt": "abc"}), Tok(), max_model_len=100, vocab_size=10)
    assert prepared.params[0].max_tokens == 97
    with_max = prepare_completion(validate_completion({"prompt": "abc", "max_tokens": 5}), Tok(), 100, 10)
    assert with_max.params[0].max_tokens == 5


def test_logprobs_zero_gives_the_chosen_token_alone(app):
    body = app.call(
        "POST",
        "/v1/completions",
        json={"prompt": "hi", "max_tokens": 3, "logprobs": 0, "temperature": 0, "ignore_eos": True},
    ).json()
    lps = body["choices"][0]["logprobs"]
    assert [list(top) for top in lps["top_logprobs"]] == [[t] for t in lps["tokens"]]
    assert [top[t] for top, t in zip(lps["top_logprobs"], lps["tokens"])] == lps["token_logprobs"]
    two = app.call(
        "POST",
        "/v1/completions",
        json={"prompt": "hi", "max_tokens": 3, "logprobs": 2, "temperature": 0, "ignore_eos": True},
    ).json()
    tops = two["choices"][0]["logprobs"]["top_logprobs"]
    # the chosen + the 2 best (fewer when the chosen is among them, or two decode alike: "\ufffd")
    assert all(1 <= len(top) <= 3 and tok in top for top, tok in zip(tops, two["choices"][0]["logprobs"]["tokens"]))
    assert max(len(top) for top in tops) >= 2
    chat = app.call(
        "POST",
        "/v1/chat/completions",
        json={"messages": USER, "max_tokens": 3, "logprobs": True, "top_logprobs": 0, "ignore_eos": True},
    ).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(e["top_logprobs"] == [] and e["logprob"] <= 0 for e in content)


def test_logprob_tokens_as_ids(app):
    body = app.call(
        "POST",
        "/v1/completions",
        json={
            "prompt": "hi",
            "max_tokens": 2,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    ).json()
    choice = body["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]


@pytest.mark.parametrize(
    "raw,param",
    [
        (b'{"prompt": "ok \\udcff"}', "prompt"),
        (b'{"prompt": ["fine", "\\ud800"]}', "prompt.1"),
        (b'{"prompt": "x", "stop": ["\\udfff"]}', "stop.0"),
        (b'{"prompt": "x", "\\udcff": 1}', "\\udcff"),  # a key: named escaped
    ],
)
def test_lone_surrogates_are_a_400(app, raw, param):
    r = app.call("POST", "/v1/completions", content=raw, headers={**app.headers, **JSON})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_unicode", r.text
    if param:
        assert r.json()["error"]["param"] == param


def test_lone_surrogates_in_chat_and_invalid_utf8_are_a_400(app):
    raw = b'{"messages": [{"role": "user", "content": "hi \\udcff"}]}'
    r = app.call("POST", "/v1/chat/completions", content=raw, headers={**app.headers, **JSON})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content"
    r = app.call("POST", "/tokenize", content=b'{"prompt": "\\udcff"}', headers={**app.headers, **JSON})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    for bad in (b'{"prompt": "\xff\xfe"}', b'{"prompt": "\xc3"}', b"\xed\xb3\xbf"):
        r = app.call("POST", "/v1/completions", content=bad, headers={**app.headers, **JSON})
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_suffix_is_refused(app):
    r = app.call("POST", "/v1/completions", json={"prompt": "def f(", "suffix": "):\n    pass"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
    assert app.call("POST", "/v1/completions", json={"prompt": "x", "suffix": None, "max_tokens": 1}).status_code == 200


def test_continuous_usage_stats_put_usage_on_every_chunk(app):
    body = {
        "prompt": "hi",
        "max_tokens": 4,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    objs = sse_objects(app.call("POST", "/v1/completions", json=body).text)[:-1]
    counts = [o["usage"]["completion_tokens"] for o in objs]
    assert counts == sorted(counts) and counts[-1] == 4 and objs[-1]["choices"] == []
    assert all(o["usage"]["prompt_tokens"] == objs[-1]["usage"]["prompt_tokens"] for o in objs)
    plain = sse_objects(
        app.call("POST", "/v1/completions", json={**body, "stream_options": {"include_usage": True}}).text
    )[:-1]
    assert all(o["usage"] is None for o in plain[:-1])


def test_stop_string_before_min_tokens_stays_in_the_text(scripted):
    """The no-thinking answer is ``The weather in Paris`` + `` is sunny.`` + EOS."""

    def ask(**kw):
        return scripted.call(
            "POST",
            "/v1/chat/completions",
            json={
                "messages": USER,
                "chat_template_kwargs": {"enable_thinking": False},
                "stop": ["Paris"],
                "logprobs": True,
                **kw,
            },
        ).json()["choices"][0], None

    cut, _ = ask()
    assert cut["message"]["content"] == "The weather in " and cut["finish_reason"] == "stop"
    full = scripted.call(
        "POST",
        "/v1/chat/completions",
        json={
            "messages": USER,
            "chat_template_kwargs": {"enable_thinking": False},
            "stop": ["Paris"],
            "min_tokens": 2,
            "logprobs": True,
        },
    ).json()
    choice = full["choices"][0]
    assert choice["message"]["content"] == HERMES_ANSWER and choice["finish_reason"] == "stop"
    assert full["usage"]["completion_tokens"] == len(choice["logprobs"]["content"]) == 3  # EOS counted
    offsets = scripted.call(
        "POST",
        "/v1/completions",
        json={
            "prompt": [scripted.server.tokenizer.convert_tokens_to_ids("<think>\n\n</think>\n\n")],
            "stop": ["Paris"],
            "min_tokens": 2,
            "logprobs": 0,
        },
    ).json()["choices"][0]
    assert offsets["text"] == HERMES_ANSWER
    assert offsets["logprobs"]["text_offset"] == [0, len("The weather in Paris"), len(HERMES_ANSWER)]


class FakeTokenizer:
    """Records what the request layer asks of a tokenizer (the tiny one has no BOS)."""

    chat_template = "{{ messages[0].content }}"

    def __init__(self) -> None:
        self.flags: list[bool] = []

    def encode(self, text, add_special_tokens=True):
        self.flags.append(add_special_tokens)
        return [1] * len(text) + ([0] if add_special_tokens else [])

    def apply_chat_template(self, messages, tokenize=False, **kwargs):
        return messages[0]["content"]


def test_sampling_fields_reach_the_engine_params():
    body = {
        "prompt": "abcd",
        "max_tokens": 7,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 5,
        "seed": 3,
        "stop": ["x"],
        "stop_token_ids": [4],
        "ignore_eos": True,
        "min_tokens": 2,
        "n": 2,
        "logprobs": 3,
    }
    prepared = prepare_completion(validate_completion(body), FakeTokenizer(), 100, 10)
    p = prepared.params[1]
    assert (
        p.max_tokens,
        p.temperature,
        p.top_p,
        p.top_k,
        p.seed,
        p.stop,
        p.stop_token_ids,
        p.ignore_eos,
        p.min_tokens,
        p.logprobs,
    ) == (7, 0.7, 0.9, 5, 4, ("x",), (4,), True, 2, 3)  # choice j: seed + j
    assert len(prepared.params) == 2 and prepared.n == 2


def test_add_special_tokens_and_truncate_prompt_tokens():
    from cluster.api.openai_service import prepare_chat
    from cluster.api.protocol import validate_chat

    tok = FakeTokenizer()
    on = prepare_completion(validate_completion({"prompt": "abc"}), tok, 100, 10)
    off = prepare_completion(validate_completion({"prompt": "abc", "add_special_tokens": False}), tok, 100, 10)
    assert tok.flags == [True, False] and on.prompt_ids[0] == [1, 1, 1, 0] and off.prompt_ids[0] == [1, 1, 1]
    chat = prepare_chat(validate_chat({"messages": [{"role": "user", "content": "abcd"}]}), tok, 100, 10)
    assert tok.flags[-1] is False and chat.prompt_ids[0] == [1] * 4  # chat: the template's own
    cut = prepare_completion(
        validate_completion({"prompt": [1, 2, 3, 4, 5], "truncate_prompt_tokens": 2}), tok, 100, 10
    )
    assert cut.prompt_ids == [[4, 5]]  # the last tokens are kept


def test_max_completion_tokens_bounds_chat(app):
    body = app.call(
        "POST",
        "/v1/chat/completions",
        json={"messages": USER, "max_completion_tokens": 3, "max_tokens": 9, "ignore_eos": True},
    ).json()
    assert body["usage"]["completion_tokens"] == 3 and body["choices"][0]["finish_reason"] == "length"


def test_error_objects_always_encode():
    """An error quoting text that is not valid Unicode is still a JSON error object, not a 500."""
    import json

    from cluster.api.errors import OpenAIError
    from cluster.api.http_api import error_response

    r = error_response(OpenAIError("unknown model `\udcff`", status=404, param="model\udcff"))
    assert r.status_code == 404 and json.loads(r.body)["error"]["message"] == "unknown model `\udcff`"
