"""The latency bench (``cluster.bench.http_latency``) against the fake OpenAI server: its
TTFT and decode rate follow the server's delays; the engine's histogram is read by name."""

from __future__ import annotations

import pytest

from cluster.bench.http_latency import engine_ttft, main, report
from tests.bench.fake_openai import FakeOpenAI

METRICS = """# TYPE hybridserve_time_to_first_token_seconds histogram
hybridserve_time_to_first_token_seconds_bucket{model="m",replica="0",le="0.01"} 1.0
hybridserve_time_to_first_token_seconds_sum{model="m",replica="0"} 0.5
hybridserve_time_to_first_token_seconds_count{model="m",replica="0"} 20.0
hybridserve_time_to_first_token_seconds_sum{model="m",replica="1"} 0.25
hybridserve_time_to_first_token_seconds_count{model="m",replica="1"} 5.0
hybridserve_time_per_output_token_seconds_sum{model="m",replica="0"} 9.0
"""


def test_engine_ttft_sums_every_replica_and_only_that_histogram():
    assert engine_ttft(METRICS) == (0.75, 25)
    assert engine_ttft("hybridserve_time_per_output_token_seconds_sum 1.0\n") is None


def test_ttft_and_decode_rate_follow_the_server():
    with FakeOpenAI(first_delay_s=0.05, token_delay_s=0.01) as srv:
        result = main(
            [
                "--url",
                srv.url,
                "--requests",
                "4",
                "--prompt-len",
                "8",
                "--stream-tokens",
                "20",
                "--streams",
                "2",
                "--seed",
                "1",
            ]
        )
    ttft = result["ttft"]
    assert 50 <= ttft["client_ms"]["min"] < 1000 and "engine_mean_ms" not in ttft  # no /metrics here
    assert all(s["events"] == 20 for s in result["stream"]["samples"])
    assert 10 < result["stream"]["best_tok_s"] <= 100 * 1.05  # 10 ms between tokens at best
    bodies = [b for b in srv.bodies if b["max_tokens"] == 1]
    assert len(bodies) == 4 and all(len(b["prompt"]) == 8 and b["stream"] for b in bodies)
    assert len({tuple(b["prompt"]) for b in srv.bodies}) == len(srv.bodies)  # never a repeated prompt
    assert "TTFT ms" in report(result)


def test_bad_arguments_are_refused_with_their_values():
    with pytest.raises(SystemExit, match="got 0, 32, 256, 3"):
        main(["--url", "http://127.0.0.1:1", "--requests", "0"])
