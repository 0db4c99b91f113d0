"""The load client against a fake OpenAI SSE server on 127.0.0.1 (no Ray), and its
arrival process."""

from __future__ import annotations

import asyncio
import math
import statistics

import pytest

from cluster.bench.client import LoadSettings, Target, arrival_times, run_benchmark
from cluster.bench.workloads import MultiTurnSpec, RandomSpec, Renderer, build
from tests.bench.fake_openai import FakeOpenAI


def test_arrivals_span_n_over_rate_and_are_seeded():
    t = arrival_times(200, rate=4.0, seed=3)
    assert t == arrival_times(200, rate=4.0, seed=3) != arrival_times(200, rate=4.0, seed=4)
    assert t == sorted(t) and t[-1] == pytest.approx(50.0)
    gaps = [b - a for a, b in zip([0.0] + t, t)]
    assert statistics.mean(gaps) == pytest.approx(0.25)
    # Poisson gaps: coefficient of variation near 1; burstier (shape 0.2) is well above it
    assert 0.8 < statistics.pstdev(gaps) / statistics.mean(gaps) < 1.2
    bursty = arrival_times(2000, rate=4.0, burstiness=0.2, seed=3)
    bg = [b - a for a, b in zip([0.0] + bursty, bursty)]
    assert statistics.pstdev(bg) / statistics.mean(bg) > 1.8
    assert arrival_times(5, math.inf) == [0.0] * 5 and arrival_times(0, 1.0) == []
    with pytest.raises(ValueError):
        arrival_times(3, 0.0)


def _run(server: FakeOpenAI, workload, **load) -> object:
    return asyncio.run(run_benchmark(Target(server.url), workload, LoadSettings(**load)))


def test_streams_are_timed_and_usage_is_read():
    w = build(RandomSpec(num_prompts=6, input_len=12, output_len=5, range_ratio=0.0))
    with FakeOpenAI(first_delay_s=0.08, token_delay_s=0.02) as server:
        res = _run(server, w, slos_ms={"ttft": 5000.0})
    body = server.bodies[0]
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["temperature"] == 0.0 and body["model"] == "fake"
    assert isinstance(body["prompt"], list) and len(body["prompt"]) == 12
    m = res.metrics
    assert m.completed == 6 and m.failed == 0 and m.total_output_tokens == 30
    assert m.total_input_tokens == 72 and m.cached_fraction == pytest.approx(0.5)
    for r in res.records:
        # Gaps are timed per chunk; a loaded machine may deliver two chunks together, and the
        # server's 20 ms sleeps are measured at the client a little early or late.
        assert r.ttft >= 0.08 and len(r.itl) == 4 and sum(r.itl) >= 0.05
        assert r.e2el >= r.ttft + 0.07 and r.tpot == pytest.approx((r.e2el - r.ttft) / 4)
    assert m.request_goodput == pytest.approx(6 / m.duration_s)


def test_max_concurrency_caps_requests_in_flight():
    w = build(RandomSpec(num_prompts=12, input_len=4, output_len=3, range_ratio=0.0))
    with FakeOpenAI(first_delay_s=0.05, token_delay_s=0.01) as server:
        res = _run(server, w, max_concurrency=3)
    assert server.peak_in_flight <= 3 and res.metrics.max_concurrency <= 3
    assert res.metrics.completed == 12


def test_rate_spreads_the_sends():
    w = build(RandomSpec(num_prompts=5, input_len=4, output_len=2, range_ratio=0.0))
    with FakeOpenAI(first_delay_s=0.0, token_delay_s=0.0) as server:
        res = _run(server, w, rate=20.0, seed=1)
    starts = sorted(r.start for r in res.records)
    assert starts[-1] - starts[0] == pytest.approx(
        arrival_times(5, 20.0, seed=1)[-1] - arrival_times(5, 20.0, seed=1)[0], abs=0.05
    )


def test_multi_turn_chat_carries_the_answers_forward():
    w = build(
        MultiTurnSpec(
            num_sessions=2,
            num_turns=3,
            system_len=4,
            first_len=3,
            user_len=2,
            output_len=2,
            api="chat",
            prompt_format="text",
        )
    )
    with FakeOpenAI(first_delay_s=0.0, token_delay_s=0.0) as server:
        res = asyncio.run(run_benchmark(Target(server.url + "/v1"), w, LoadSettings(), Renderer()))
    assert res.metrics.completed == 6 and [lab.turn for lab in res.labels] == [0, 1, 2, 0, 1, 2]
    last = [b for b in server.bodies if len(b["messages"]) == 6]
    assert len(last) == 2
    roles = [m["role"] for m in last[0]["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user"]
    assert last[0]["messages"][2]["content"] == "t0 t1 "  # the first answer, as streamed
    # the empty role delta is not the first token: TTFT and token counts come from content
    assert all(len(r.itl) == 1 for r in res.records)


def test_failed_requests_are_counted_not_raised():
    w = build(RandomSpec(num_prompts=3, input_len=2, output_len=2, range_ratio=0.0, prompt_format="text"))
    r = Renderer()
    with FakeOpenAI(first_delay_s=0.0, token_delay_s=0.0) as server:
        server.fail_prompts.add(r.text(w.sessions[1].first_prompt_ids()))
        res = asyncio.run(run_benchmark(Target(server.url), w, LoadSettings(), r))
    assert isinstance(server.bodies[0]["prompt"], str)
    assert res.metrics.completed == 2 and res.metrics.failed == 1
    assert "HTTP 400" in [x for x in res.records if not x.success][0].error
