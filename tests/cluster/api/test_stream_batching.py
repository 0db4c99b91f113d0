"""Stream batching over HTTP, in process (no Ray): with the replica's ``stream_interval_s``
one SSE event carries the tokens of several engine steps, and a client reads the same
text, token ids, logprobs, usage, stops and tool calls as from an unbatched stream and
from the non-streamed response (chunk boundaries may change, contents not)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from tests.cluster.api.conftest import sse_objects
from tests.cluster.api.scripted_model import HERMES_CALLS, HERMES_REASONING, TOOLS
from tests.cluster.api.test_tools_reasoning import assemble, chat, stream

INTERVAL_S = 0.2  # far above a tiny-model step: every event batches
PROMPTS = ["the cat sat on", "once upon a time", "hello world", "a b c d"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def batched(local_app, tiny_qwen_dir):
    return local_app(tiny_qwen_dir, "tiny", stream_interval_s=INTERVAL_S)


@pytest.fixture(scope="module")
def unbatched(local_app, tiny_qwen_dir):
    return local_app(tiny_qwen_dir, "tiny")


def post_all(app: Any, path: str, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    """The requests at once (so they share engine steps), responses in order."""

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app.api), base_url="http://t") as c:
            return list(await asyncio.gather(*(c.post(path, json=b) for b in bodies)))

    return app.loop.run_until_complete(go())


def read_stream(text: str) -> dict[str, Any]:
    """What a client rebuilds from a completions stream, and its number of content events."""
    objs = sse_objects(text)
    assert objs[-1] == "[DONE]"
    out: dict[str, Any] = {
        "text": "",
        "token_ids": [],
        "tokens": [],
        "token_logprobs": [],
        "offsets": [],
        "events": 0,
        "finish": None,
        "usage": objs[-2]["usage"],
    }
    for o in objs[:-2]:
        (ch,) = o["choices"]
        out["events"] += bool(ch["text"] or ch.get("token_ids"))
        out["text"] += ch["text"]
        out["token_ids"] += ch.get("token_ids") or []
        lps = ch["logprobs"] or {"tokens": [], "token_logprobs": [], "text_offset": []}
        out["tokens"] += lps["tokens"]
        out["token_logprobs"] += lps["token_logprobs"]
        out["offsets"] += lps["text_offset"]
        out["finish"] = ch["finish_reason"] or out["finish"]
    return out


def counts(usage: dict[str, Any]) -> tuple[int, int]:
    return usage["prompt_tokens"], usage["completion_tokens"]


def completion(prompt: str, stream_it: bool, **extra: Any) -> dict[str, Any]:
    body = {
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 1,
        "return_token_ids": True,
        "stream": stream_it,
        **extra,
    }
    if stream_it:
        body["stream_options"] = {"include_usage": True}
    return body


def test_a_batched_stream_has_fewer_events_than_tokens_and_the_same_contents(batched, unbatched):
    fast = [read_stream(r.text) for r in post_all(batched, "/v1/completions", [completion(p, True) for p in PROMPTS])]
    slow = [read_stream(r.text) for r in post_all(unbatched, "/v1/completions", [completion(p, True) for p in PROMPTS])]
    whole = [r.json() for r in post_all(unbatched, "/v1/completions", [completion(p, False) for p in PROMPTS])]
    for got, ref, body in zip(fast, slow, whole):
        (choice,) = body["choices"]
        assert len(got["token_ids"]) == MAX_TOKENS and got["events"] < MAX_TOKENS  # several tokens per event
        assert ref["events"] > got["events"]
        for key in ("text", "token_ids", "tokens", "offsets", "finish", "usage"):
            assert got[key] == ref[key], key
        assert got["token_logprobs"] == pytest.approx(ref["token_logprobs"], abs=1e-5)
        assert got["text"] == choice["text"] and got["token_ids"] == choice["token_ids"]
        assert got["tokens"] == choice["logprobs"]["tokens"]
        assert got["offsets"] == choice["logprobs"]["text_offset"]
        assert got["token_logprobs"] == pytest.approx(choice["logprobs"]["token_logprobs"], abs=1e-5)
        assert counts(got["usage"]) == counts(body["usage"])  # cached_tokens: the apps' caches differ


def test_stop_strings_and_n_survive_batching(batched, unbatched):
    full = unbatched.call("POST", "/v1/completions", json=completion(PROMPTS[0], False)).json()["choices"][0]["text"]
    stop = next(
        full[k : k + 3] for k in range(4, len(full) - 3) if full.find(full[k : k + 3]) == k and full[k : k + 3].strip()
    )
    want = unbatched.call("POST", "/v1/completions", json=completion(PROMPTS[0], False, stop=[stop], n=2)).json()
    objs = sse_objects(
        batched.call("POST", "/v1/completions", json=completion(PROMPTS[0], True, stop=[stop], n=2)).text
    )
    texts, finish = ["", ""], [None, None]
    for o in objs[:-2]:
        for ch in o["choices"]:
            texts[ch["index"]] += ch["text"]
            finish[ch["index"]] = ch["finish_reason"] or finish[ch["index"]]
    assert texts == [c["text"] for c in want["choices"]] and texts[0] == full[: full.find(stop)]
    assert finish == ["stop", "stop"] and counts(objs[-2]["usage"]) == counts(want["usage"])


def test_tool_calls_and_reasoning_survive_batching(local_app, scripted_hermes_dir):
    hermes = local_app(scripted_hermes_dir, "scripted", stream_interval_s=INTERVAL_S)
    objs = stream(hermes, tools=TOOLS, stream_options={"include_usage": True})
    assert assemble(objs) == (HERMES_REASONING, "", HERMES_CALLS, "tool_calls")
    assert counts(objs[-2]["usage"]) == counts(chat(hermes, tools=TOOLS)["usage"])
