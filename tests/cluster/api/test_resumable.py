"""``ResumableStream`` over a real tiny engine, no Ray: a client whose replica streams die
on cue (``FlakyClient``). The resumed answer equals the undisturbed one (stream and not,
n > 1, logprobs, usage); a replica dying before it accepts, or before the first token, is
retried; a grammar, penalties and stop strings resume exactly; what cannot be resumed ends
with an OpenAI error, never silently."""

from __future__ import annotations

import json

import pytest

from cluster.api.http_api import make_api
from cluster.api.openai_server import OpenAIServer
from cluster.api.resumable import ResumeSettings, StreamCounters
from tests.cluster.api.conftest import App, sse_objects


class ReplicaDied(RuntimeError):
    pass


class FlakyStream:
    """The inner stream, dying after ``items`` items (0: before ``Accepted``)."""

    def __init__(self, inner, items: int | None) -> None:
        self.inner, self.items, self.seen = inner, items, 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.items is not None and self.seen >= self.items:
            self.inner.cancel()
            raise ReplicaDied("the replica's actor died")
        self.seen += 1
        return await self.inner.__anext__()

    def cancel(self) -> None:
        self.inner.cancel()


class FlakyClient:
    """``EngineClient`` whose n-th ``generate`` dies after ``plan[n]`` items (None: never)."""

    def __init__(self, inner, plan: list[int | None]) -> None:
        self.inner, self.plan, self.requests = inner, list(plan), []

    def generate(self, req):
        self.requests.append(req)
        items = self.plan.pop(0) if self.plan else None
        return FlakyStream(self.inner.generate(req), items)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def base(local_app, tiny_qwen_dir) -> App:
    return local_app(tiny_qwen_dir)


def flaky(base: App, plan: list[int | None], **settings) -> tuple[App, FlakyClient, StreamCounters]:
    client = FlakyClient(base.server.client, plan)
    resume = ResumeSettings(retry_open=lambda e: isinstance(e, ReplicaDied), backoff_s=0.01, **settings)
    counters = StreamCounters()
    server = OpenAIServer(client, base.server.tokenizer, base.server.settings, resume, counters)
    return App(base.loop, make_api(server), base.core, server, {}), client, counters


def completion(app: App, **fields) -> dict:
    body = {"model": "tiny", "prompt": "resume me please", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    r = app.call("POST", "/v1/completions", json={**body, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def streamed(app: App, **fields) -> tuple[list[dict], list[dict]]:
    body = {"model": "tiny", "prompt": "resume me please", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    r = app.call("POST", "/v1/completions", json={**body, **fields, "stream": True})
    assert r.status_code == 200, r.text
    objs = sse_objects(r.text)
    assert objs[-1] == "[DONE]"
    return [o for o in objs[:-1] if "error" not in o], [o["error"] for o in objs[:-1] if "error" in o]


def joined(events: list[dict], n: int = 1) -> list[tuple[list[int], str]]:
    out = [([], "") for _ in range(n)]
    for e in events:
        for c in e["choices"]:
            ids, text = out[c["index"]]
            out[c["index"]] = (ids + (c.get("token_ids") or []), text + c["text"])
    return out


FIELDS = {"n": 2, "logprobs": 1, "return_token_ids": True, "stream_options": {"include_usage": True}}


@pytest.mark.parametrize("die_after", [2, 4, 7])
def test_a_stream_resumed_mid_answer_equals_the_undisturbed_one(base, die_after):
    want, _ = streamed(base, **FIELDS)
    app, client, counters = flaky(base, [die_after, 3])  # the resumed stream dies too
    got, errors = streamed(app, **FIELDS)
    assert not errors
    assert joined(got, 2) == joined(want, 2)
    assert got[-1]["usage"]["prompt_tokens"] == want[-1]["usage"]["prompt_tokens"]
    assert got[-1]["usage"]["completion_tokens"] == want[-1]["usage"]["completion_tokens"] == 24
    lps = [c["logprobs"]["token_logprobs"] for e in got for c in e["choices"] if c["logprobs"]]
    assert len([x for chunk in lps for x in chunk]) == 24
    assert counters.totals[("hybridserve_stream_migrations_total", None)] == 2
    assert [len(r.output_prefixes) for r in client.requests] == [0, 2, 2]
    assert all(len(c) > 0 for c in client.requests[2].output_prefixes)


@pytest.mark.parametrize("die_after", [2, 5])
def test_a_seeded_stream_resumed_mid_answer_equals_the_undisturbed_one(base, die_after):
    seeded = {**FIELDS, "seed": 5, "temperature": 1.0, "top_p": 0.9}  # draws keyed by position
    want, _ = streamed(base, **seeded)
    app, client, counters = flaky(base, [die_after, 3])
    got, errors = streamed(app, **seeded)
    assert not errors
    assert joined(got, 2) == joined(want, 2)
    assert counters.totals[("hybridserve_stream_migrations_total", None)] == 2
    assert all(len(c) > 0 for c in client.requests[2].output_prefixes)


def test_a_collected_answer_is_resumed_too(base):
    want = completion(base, logprobs=0)
    app, _, counters = flaky(base, [3])
    got = completion(app, logprobs=0)
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert got["choices"][0]["logprobs"]["tokens"] == want["choices"][0]["logprobs"]["tokens"]
    assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
    assert counters.totals == {("hybridserve_stream_migrations_total", None): 1}


@pytest.mark.parametrize("plan", [[0, 0], [1]])  # before Accepted (twice), after it but before a token
def test_a_replica_dying_before_the_first_token_is_retried(base, plan):
    want = completion(base, seed=3, temperature=1.0)  # seeded: a retry draws the same tokens
    app, client, counters = flaky(base, plan)
    got = completion(app, seed=3, temperature=1.0)
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert counters.totals == {("hybridserve_stream_retries_total", None): 1}
    assert all(not r.output_prefixes for r in client.requests)


def test_no_replica_accepting_the_resume_ends_the_stream_with_an_error(base):
    app, _, counters = flaky(base, [3] + [0] * 100, timeout_s=0.3)
    events, errors = streamed(app)
    assert events and errors and errors[0]["code"] == "engine_unavailable"
    assert "within 0.3 s" in errors[0]["message"]
    assert counters.totals[("hybridserve_stream_resume_failures_total", "timeout")] == 1


def test_resumes_are_bounded(base):
    app, _, counters = flaky(base, [2, 2, 2], max_resumes=2)
    _, errors = streamed(app)
    assert errors[0]["code"] == "engine_unavailable" and "after 2 resumes" in errors[0]["message"]
    assert counters.totals[("hybridserve_stream_resume_failures_total", "exhausted")] == 1
    assert base.core.loop.num_streams == 0  # every replica stream was closed


@pytest.mark.parametrize(
    "fields",
    [
        {"structured_outputs": {"regex": "[a-z]{10,}"}, "max_tokens": 16, "seed": 2, "temperature": 1.0},
        {"presence_penalty": -1.5, "frequency_penalty": 0.5, "stop": ["e"], "min_tokens": 4},
    ],
)
def test_output_dependent_sampling_resumes_exactly(base, fields):
    """A grammar, penalties over output tokens and stop strings resume from the tokens sent:
    the new replica's engine and detokenizer replay them (``output_prefixes``)."""
    want, _ = streamed(base, return_token_ids=True, **fields)
    app, client, counters = flaky(base, [3])
    got, errors = streamed(app, return_token_ids=True, **fields)
    assert not errors and joined(got) == joined(want)
    assert counters.totals == {("hybridserve_stream_migrations_total", None): 1}
    assert len(client.requests[1].output_prefixes[0]) > 0


def test_an_unretryable_open_error_is_a_503_at_once(base):
    app, client, counters = flaky(base, [])
    client.generate = lambda req: _Overloaded()  # type: ignore[method-assign]
    r = app.call("POST", "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 503 and json.loads(r.text)["error"]["code"] == "engine_unavailable"
    assert counters.totals == {}


class _Overloaded:
    async def __anext__(self):
        raise RuntimeError("every replica is busy")

    def cancel(self) -> None:
        pass
