"""The OpenAI API end to end through Ray Serve, with the official ``openai`` client."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.conftest import wait_until

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]
KEY = "sk-e2e"
MODEL = "tiny-e2e"


@pytest.fixture(scope="module")
def app(deployed, tiny_qwen_dir):
    return deployed("oai", str(tiny_qwen_dir), overrides={"server": {"api_key": KEY}}, args={"model_name": MODEL})


@pytest.fixture(scope="module")
def client(app) -> openai.OpenAI:
    return openai.OpenAI(base_url=app.openai_base, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(app):
    with httpx.Client(base_url=app.base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


def test_models_health_and_api_key(app, client, http):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    raw = http.get("/v1/models").json()["data"][0]
    # bench clients load it
    assert Path(raw["root"]).is_absolute() and Path(raw["root"], "config.json").is_file()
    assert raw["max_model_len"] > 100
    assert httpx.get(f"{app.base_url}/health").status_code == 200  # no key needed
    r = httpx.get(f"{app.openai_base}/models", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_completions_stream_and_cached_tokens(client):
    kwargs = dict(
        model=MODEL,
        prompt="a quick brown fox jumps over the dog",
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert first.usage.completion_tokens == 10
    assert again.choices[0].text == first.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == first.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == first.usage.total_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_chat_with_the_checkpoint_template(client):
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}],
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.chat.completions.create(**kwargs)
    assert full.choices[0].message.role == "assistant" and full.usage.completion_tokens == 8
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 8


def test_n_seed_logprobs_stop_and_token_ids(client):
    kwargs = dict(
        model=MODEL,
        prompt=[11, 12, 13, 14, 15],
        max_tokens=6,
        n=2,
        seed=5,
        temperature=1.0,
        logprobs=2,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    a, b = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert len(a.choices) == 2
    assert [c.model_extra["token_ids"] for c in a.choices] == [c.model_extra["token_ids"] for c in b.choices]
    assert a.model_extra["prompt_token_ids"] == [11, 12, 13, 14, 15]
    assert len(a.choices[0].logprobs.token_logprobs) == 6
    assert all(len(t) <= 3 for t in a.choices[0].logprobs.top_logprobs)  # the chosen + the 2 best
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        temperature=0,
    )
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens
    base = (
        client.completions.create(
            model=MODEL, prompt="stop here", max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    stop = next(base[i : i + 2] for i in range(1, len(base) - 1) if "\ufffd" not in base[i : i + 2])
    cut = client.completions.create(
        model=MODEL, prompt="stop here", max_tokens=16, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    ).choices[0]
    assert cut.text == base[: base.index(stop)] and cut.finish_reason == "stop"


BAD_CASES = {
    "unknown model": (dict(model="nope"), 404),
    "prompt too long": (dict(prompt=[5] * 5000), 400),
    "max_tokens 0": (dict(max_tokens=0), 400),
    "max_tokens negative": (dict(max_tokens=-1), 400),
    "temperature < 0": (dict(temperature=-1.0), 400),
    "top_p 0": (dict(top_p=0.0), 400),
    "top_p > 1": (dict(top_p=1.5), 400),
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_requests_are_4xx_error_objects(client, case, stream):
    fields, status = BAD_CASES[case]
    kwargs = {"model": MODEL, "prompt": "hi", "max_tokens": 4, **fields}
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(**kwargs, stream=stream)
    assert info.value.status_code == status
    err = info.value.body
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]


def test_malformed_json_and_bad_chat_are_4xx(http):
    for path, body in (
        ("/v1/completions", b'{"prompt": "x",'),
        ("/v1/chat/completions", b"[]"),
        ("/v1/chat/completions", json.dumps({"messages": [], "stream": True}).encode()),
    ):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, (path, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def _replica(http) -> dict:
    replicas = http.get("/debug/replicas").json()["replicas"]
    assert len(replicas) == 1
    return replicas[0]


def test_client_disconnect_aborts_and_frees_the_pools(http):
    http.post("/flush_cache").raise_for_status()
    idle = _replica(http)["pools"]
    assert idle["kv_pages_free"] == idle["kv_pages_usable"]
    aborted_before = _replica(http)["counters"]["hybridserve_requests_total"].get("abort", 0)
    body = {"model": MODEL, "prompt": "once upon a time", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [line for line, _ in zip(lines, range(6)) if line.startswith("data: ")]
        assert got
        assert _replica(http)["num_streams"] == 1
    # the response is closed: the proxy sees the disconnect, the ingress cancels the replica call

    def settled():
        rep = _replica(http)
        return rep if rep["num_streams"] == 0 and not rep["has_unfinished"] else None

    rep = wait_until(settled, timeout_s=30)
    assert rep["counters"]["hybridserve_requests_total"].get("abort", 0) == aborted_before + 1
    assert rep["counters"]["hybridserve_generation_tokens_total"] < 1500
    http.post("/flush_cache").raise_for_status()
    assert _replica(http)["pools"] == idle


def _scrape(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for s in fam.samples:
            key = s.name + json.dumps(dict(sorted(s.labels.items())))
            out[key] = s.value
    return out


def _total(samples: dict[str, float], name: str) -> float:
    return sum(v for k, v in samples.items() if k.startswith(name + "{"))


def test_metrics_counters_move_after_traffic(app, client):
    def scraped():
        s = _scrape(app.metrics_url)
        return s if _total(s, "hybridserve_generation_tokens_total") > 0 else None

    before = wait_until(scraped, timeout_s=30)
    client.completions.create(
        model=MODEL, prompt="count me", max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )

    def moved():
        s = _scrape(app.metrics_url)
        name = "hybridserve_generation_tokens_total"
        grown = _total(s, name) >= _total(before, name) + 7
        return s if grown else None

    after = wait_until(moved, timeout_s=30)
    labels = [k for k in after if k.startswith("hybridserve_generation_tokens_total{")]
    assert labels and all('"model": "tiny-e2e"' in k and '"replica": "0"' in k for k in labels)
    assert _total(after, "hybridserve_time_to_first_token_seconds_count") > 0
    assert _total(after, "hybridserve_requests_total") > _total(before, "hybridserve_requests_total")


def test_service_endpoints_through_serve(app, client, http):
    """/tokenize, /detokenize, /tokenizer_info, /version, /ping, /v1/models/{id}, /metrics on
    the API port (the metrics actor's text), logprobs=0 and continuous usage stats."""
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.created > 1_700_000_000
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    tokens = http.post("/tokenize", json={"model": MODEL, "prompt": "hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == "hello world"
    chat_ids = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1, extra_body={"return_token_ids": True}
    )
    assert chat.model_extra["prompt_token_ids"] == chat_ids
    assert http.get("/tokenizer_info").json()["tokenizer_class"]
    assert http.get("/version").json()["version"]
    assert httpx.get(f"{app.base_url}/ping").status_code == 200  # no key, as /health
    text = http.get("/metrics").text
    assert "hybridserve_requests_total" in text and 'model="tiny-e2e"' in text
    zero = client.completions.create(
        model=MODEL, prompt="hi", max_tokens=3, logprobs=0, extra_body={"ignore_eos": True}
    )
    lps = zero.choices[0].logprobs
    assert [list(top) for top in lps.top_logprobs] == [[tok] for tok in lps.tokens]
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="hi",
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert all(c.usage is not None for c in chunks) and chunks[-1].usage.completion_tokens == 3
