"""The OpenAI HTTP app over an in-process replica (no Ray): semantics and error contract."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from cluster.api.http_api import make_api
from cluster.api.openai_server import OpenAIServer, ServerSettings
from cluster.serving.engine_client import LocalEngineClient
from cluster.serving.replica_core import ReplicaCore
from configs.schema import load_config

KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def env(tiny_qwen_dir):
    loop = asyncio.new_event_loop()
    config = load_config(
        overrides={
            "model": str(tiny_qwen_dir),
            "device": "cpu",
            "dtype": "float32",
            "cache": {"page_size": 4, "max_kv_tokens": 2048, "max_mamba_slots": 32},
            "server": {"api_key": KEY},
        }
    )
    core = loop.run_until_complete(ReplicaCore.create(config))
    server = OpenAIServer(
        LocalEngineClient(core), core.loop.engine.tokenizer, ServerSettings("tiny", str(tiny_qwen_dir), KEY)
    )
    yield loop, make_api(server), core
    loop.run_until_complete(core.shutdown())
    loop.close()


def call(env, method: str, path: str, headers=AUTH, **kwargs) -> httpx.Response:
    loop, app, _ = env

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.request(method, path, headers=headers, **kwargs)

    return loop.run_until_complete(go())


def sse_objects(text: str) -> list:
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    return [e[6:] if e[6:] == "[DONE]" else json.loads(e[6:]) for e in events]


def test_models_and_health(env):
    data = call(env, "GET", "/v1/models").json()["data"][0]
    assert data["id"] == "tiny" and data["max_model_len"] > 0 and data["root"]
    assert call(env, "GET", "/health", headers={}).status_code == 200


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_api_key_is_required_except_for_health(env, headers):
    r = call(env, "GET", "/v1/models", headers=headers)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_stream_equals_non_stream_and_cached_tokens_on_repeat(env):
    body = {
        "model": "tiny",
        "prompt": "the cat sat on the mat and looked",
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
    }
    first = call(env, "POST", "/v1/completions", json=body).json()
    again = call(env, "POST", "/v1/completions", json=body).json()
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    r = call(env, "POST", "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.headers["content-type"].startswith("text/event-stream")
    objs = sse_objects(r.text)
    assert objs[-1] == "[DONE]" and objs[-2]["choices"] == []
    assert "".join(o["choices"][0]["text"] for o in objs[:-2]) == first["choices"][0]["text"]
    assert objs[-2]["usage"]["completion_tokens"] == 12
    assert objs[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_chat_uses_the_template_and_streams_roles_first(env):
    body = {
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "logprobs": True,
        "top_logprobs": 2,
    }
    full = call(env, "POST", "/v1/chat/completions", json=body).json()
    choice = full["choices"][0]
    assert choice["message"]["role"] == "assistant" and len(choice["token_ids"]) == 6
    assert len(choice["logprobs"]["content"]) == 6
    assert all(len(e["top_logprobs"]) == 2 for e in choice["logprobs"]["content"])
    objs = sse_objects(call(env, "POST", "/v1/chat/completions", json={**body, "stream": True}).text)
    assert objs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    streamed = [t for o in objs[1:-1] for t in o["choices"][0].get("token_ids", [])]
    assert streamed == choice["token_ids"] and objs[-2]["choices"][0]["finish_reason"] == "length"


def test_n_seed_stop_and_token_ids(env):
    body = {
        "prompt": [7, 8, 9, 10],
        "max_tokens": 8,
        "n": 2,
        "seed": 11,
        "temperature": 1.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "logprobs": 1,
    }
    a = call(env, "POST", "/v1/completions", json=body).json()
    b = call(env, "POST", "/v1/completions", json=body).json()
    assert [c["token_ids"] for c in a["choices"]] == [c["token_ids"] for c in b["choices"]]
    assert a["prompt_token_ids"] == [7, 8, 9, 10] and len(a["choices"]) == 2
    assert len(a["choices"][0]["logprobs"]["token_logprobs"]) == 8
    greedy = call(
        env, "POST", "/v1/completions", json={"prompt": "abc", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    ).json()
    text = greedy["choices"][0]["text"]
    stop = next(text[i : i + 2] for i in range(1, len(text) - 1) if "\ufffd" not in text[i : i + 2])
    cut = call(
        env,
        "POST",
        "/v1/completions",
        json={"prompt": "abc", "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stop": [stop]},
    ).json()
    assert cut["choices"][0]["text"] == text[: text.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


BAD = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"prompt": "x", "model": "other"}, 404, "model"),
    ("/v1/completions", {"prompt": [5] * 5000}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": [99999]}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, 400, None),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path,body,status,param", BAD)
def test_bad_requests_get_an_openai_error_before_any_stream(env, path, body, status, param, stream):
    if isinstance(body, dict):
        body = json.dumps({**body, "stream": stream}).encode()
    r = call(env, "POST", path, content=body, headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == status
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param


def test_request_id_is_echoed_on_success_streams_and_errors(env):
    rid = {"x-request-id": "abc-123"}
    assert call(env, "GET", "/v1/models", headers={**AUTH, **rid}).headers["x-request-id"] == "abc-123"
    r = call(
        env, "POST", "/v1/completions", headers={**AUTH, **rid}, json={"prompt": "x", "max_tokens": 2, "stream": True}
    )
    assert r.headers["x-request-id"] == "abc-123"
    assert call(env, "GET", "/v1/models", headers=rid).headers["x-request-id"] == "abc-123"  # 401


def test_unknown_route_and_method_are_error_objects(env):
    r = call(env, "GET", "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert call(env, "GET", "/v1/completions").status_code == 405


def test_leaving_a_stream_early_frees_the_pools(env):
    loop, app, core = env
    call(env, "POST", "/flush_cache")
    idle = call(env, "GET", "/debug/replicas").json()["replicas"][0]["pools"]
    assert idle["kv_pages_free"] == idle["kv_pages_usable"]
    body = {"prompt": "tell me a long story", "max_tokens": 1500, "ignore_eos": True, "stream": True}

    server: OpenAIServer = app.state.server

    async def read_some_then_leave():
        started = await server.start_completion(json.dumps(body).encode())
        events = server.events(started)
        got = [await events.__anext__() for _ in range(3)]
        await events.aclose()  # what Starlette does when the client goes
        return got

    got = loop.run_until_complete(read_some_then_leave())
    assert len(got) == 3
    for _ in range(200):
        stats = call(env, "GET", "/debug/replicas").json()["replicas"][0]
        if stats["num_streams"] == 0 and not stats["has_unfinished"]:
            break
        loop.run_until_complete(asyncio.sleep(0.01))
    assert stats["counters"]["hybridserve_requests_total"].get("abort", 0) >= 1
    call(env, "POST", "/flush_cache")
    assert call(env, "GET", "/debug/replicas").json()["replicas"][0]["pools"] == idle
