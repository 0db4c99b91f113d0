"""Graceful shutdown and redeploy with requests in flight.

- Drain then delete (``serve_local.drain``, what ``hybridserve serve`` does on a signal):
  streams in flight run to completion; new requests -- ``/health`` included -- get 503
  ``server_shutting_down`` with ``Retry-After`` at once. After ``serve.delete`` the Serve
  proxy has dropped the route and answers 404 in plain text (Serve's, not ours).
- Redeploy (slow; ``serve.run`` of the same app with changed options) while streams run
  and a client keeps sending: every in-flight stream ends with all its tokens and
  ``[DONE]`` (Serve drains the old replicas for up to ``graceful_shutdown_timeout_s``);
  requests sent during the rollout are served (or refused with a 503 error object).
- ``hybridserve serve`` under SIGTERM to its whole process group (slow: a Ray cluster
  of its own): the ingress drains -- new requests get 503 ``server_shutting_down`` with
  ``Retry-After`` -- the in-flight stream completes, the process exits 0 (printed: how
  long after the signal), and then the port refuses connections.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests.reliability.conftest import deploy, wait_until

pytestmark = [pytest.mark.ray, pytest.mark.timeout(420)]
MODEL = "shut"
GRACE_S = 15.0
STREAM_TOKENS = 120
GRACE_CLI_S = 20.0  # ingress.graceful_shutdown_timeout_s' default
ROOT = Path(__file__).resolve().parents[2]
ARGS = {
    "model_name": MODEL,
    "ingress": {"graceful_shutdown_timeout_s": GRACE_S, "graceful_shutdown_wait_loop_s": 0.5},
    "replica": {
        "num_cpus": 1,
        "stats_interval_s": 0.2,
        "events_interval_s": 0.02,
        "graceful_shutdown_timeout_s": GRACE_S,
        "graceful_shutdown_wait_loop_s": 0.5,
    },
}


def read_stream(
    base_url: str, k: int, out: dict[int, tuple[int, int, bool]], model: str = MODEL, max_tokens: int = STREAM_TOKENS
) -> None:
    """One streaming completion; ``out[k] = (status, completion tokens, ended with [DONE])``."""
    body = {
        "model": model,
        "prompt": f"long story {k}",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    if r.status_code != 200 or not events:
        out[k] = (r.status_code, 0, False)
        return
    usage = json.loads(events[-2]).get("usage") if len(events) > 1 else None
    out[k] = (200, usage["completion_tokens"] if usage else 0, events[-1] == "[DONE]")


def start_streams(base_url: str, num: int) -> tuple[list[threading.Thread], dict[int, tuple[int, int, bool]]]:
    out: dict[int, tuple[int, int, bool]] = {}
    threads = [threading.Thread(target=read_stream, args=(base_url, k, out), daemon=True) for k in range(num)]
    for t in threads:
        t.start()
    return threads, out


def wait_streaming(http: httpx.Client, num: int) -> None:
    deadline = time.monotonic() + 60
    while sum(r["num_streams"] for r in http.get("/debug/replicas").json()["replicas"]) < num:
        assert time.monotonic() < deadline, "streams did not start"
        time.sleep(0.02)


def probe(base_url: str) -> tuple[int, str, float]:
    """A short completion: (status, error code or body head, latency)."""
    t0 = time.monotonic()
    try:
        r = httpx.post(f"{base_url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}, timeout=30)
    except httpx.ConnectError:
        return -1, "connection refused", time.monotonic() - t0
    try:
        detail = str(r.json()["error"]["code"]) if r.status_code != 200 else "ok"
    except (ValueError, KeyError, TypeError):
        detail = r.text[:60]
    return r.status_code, detail, time.monotonic() - t0


@pytest.fixture(scope="module")
def app(deployed, tiny_qwen_dir):
    return deployed(MODEL, str(tiny_qwen_dir), args=ARGS)


@pytest.mark.slow
def test_redeploy_completes_in_flight_streams(serve_session, app, tiny_qwen_dir):
    with httpx.Client(base_url=app.base_url, timeout=60) as http:
        threads, out = start_streams(app.base_url, 3)
        wait_streaming(http, 3)
        probes: list[tuple[int, str, float]] = []
        stop = threading.Event()

        def keep_probing() -> None:
            while not stop.is_set():
                probes.append(probe(app.base_url))

        prober = threading.Thread(target=keep_probing, daemon=True)
        prober.start()
        t0 = time.monotonic()
        changed = {**ARGS, "replica": {**ARGS["replica"], "stats_interval_s": 0.3}}
        deploy(serve_session, MODEL, str(tiny_qwen_dir), args=changed)  # blocks until rolled out
        rollout_s = time.monotonic() - t0
        for t in threads:
            t.join(timeout=120)
        stop.set()
        prober.join(timeout=60)
    kinds = Counter((s, d) for s, d, _ in probes)
    print(
        f"\n[redeploy] rolled out in {rollout_s:.1f} s; in-flight streams {out}; "
        f"{len(probes)} requests during the rollout: {dict(kinds)}"
    )
    assert out == {k: (200, STREAM_TOKENS, True) for k in range(3)}
    assert probes and set(kinds) <= {(200, "ok"), (503, "engine_unavailable"), (503, "server_overloaded")}


def test_drain_then_delete(app):
    """``serve_local.drain`` (what ``hybridserve serve`` does on SIGTERM), then ``serve.delete``."""
    from ray import serve

    from cluster.serve_local import drain

    with httpx.Client(base_url=app.base_url, timeout=60) as http:
        threads, out = start_streams(app.base_url, 2)
        wait_streaming(http, 2)
        t0 = time.monotonic()
        left: list[int] = []
        drainer = threading.Thread(target=lambda: left.append(drain(app.name, GRACE_S, threading.Event())))
        drainer.start()
        wait_until(lambda: http.get("/health").status_code == 503, timeout_s=10, interval_s=0.02)
        during = [probe(app.base_url) for _ in range(5)]
        refused = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        drainer.join(timeout=GRACE_S + 10)
        drained_s = time.monotonic() - t0
        for t in threads:
            t.join(timeout=30)
    serve.delete(app.name)
    after = probe(app.base_url)
    print(
        f"\n[drain] in-flight streams {out}, drained {drained_s:.1f} s after it began ({left} left); "
        f"new requests meanwhile: {dict(Counter((s, d) for s, d, _ in during))}, slowest "
        f"{max(p[2] for p in during) * 1000:.0f} ms; after serve.delete: {after[0]} {after[1]!r}"
    )
    assert left == [0]
    assert out == {k: (200, STREAM_TOKENS, True) for k in range(2)}
    assert all(s == 503 and d == "server_shutting_down" and lat < 2 for s, d, lat in during), during
    assert refused.headers.get("retry-after") is not None
    assert refused.json()["error"]["type"] == "service_unavailable"
    assert after[0] == 404  # the Serve proxy, route gone: plain text, not ours


def _serve_cli(model_dir: str, port: int, metrics_port: int, log_path: Path) -> subprocess.Popen[bytes]:
    sets = {
        "model": model_dir,
        "device": "cpu",
        "dtype": "float32",
        "server.port": port,
        "metrics.port": metrics_port,
        "cache.max_kv_tokens": 2048,
        "cache.max_mamba_slots": 32,
        "cache.page_size": 4,
        "scheduler.max_running_requests": 8,
    }
    argv = [str(Path(sys.executable).with_name("hybridserve")), "serve", "--num-cpus", "4"]
    for key, value in sets.items():
        argv += ["--set", f"{key}={value}"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a cluster of its own
    return subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=log_path.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )


@pytest.mark.slow
def test_cli_sigterm_drains_and_exits_zero(tiny_qwen_dir, tmp_path):
    from tests.conftest import free_port

    port, log = free_port(), tmp_path / "serve.log"
    base = f"http://127.0.0.1:{port}"
    proc = _serve_cli(str(tiny_qwen_dir), port, free_port(), log)
    try:

        def ready() -> bool:
            assert proc.poll() is None, f"hybridserve serve exited early:\n{log.read_text()[-3000:]}"
            try:
                return httpx.get(f"{base}/v1/models", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, timeout_s=240, interval_s=0.5)
        model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        out: dict[int, tuple[int, int, bool]] = {}
        stream = threading.Thread(target=read_stream, args=(base, 0, out, model, 400), daemon=True)
        stream.start()
        wait_until(
            lambda: httpx.get(f"{base}/debug/replicas", timeout=10).json()["replicas"][0]["num_streams"],
            timeout_s=60,
            interval_s=0.02,
        )
        t_term = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        wait_until(lambda: httpx.get(f"{base}/health", timeout=10).status_code == 503, timeout_s=10, interval_s=0.02)
        refused = httpx.post(
            f"{base}/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2}, timeout=10
        )
        stream.join(timeout=60)
        code = proc.wait(timeout=GRACE_CLI_S + 30)
        exit_s = time.monotonic() - t_term
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{base}/health", timeout=5)
    print(
        f"\n[cli sigterm] in-flight stream {out}; request during the drain: {refused.status_code} "
        f"{refused.json()['error']['code']} retry-after={refused.headers.get('retry-after')}; "
        f"exit code {code} {exit_s:.1f} s after SIGTERM; afterwards: connection refused"
    )
    assert code == 0, log.read_text()[-3000:]
    assert exit_s < GRACE_CLI_S + 15  # drain + Serve and Ray stop (~10 s on 2 cores)
    assert out == {0: (200, 400, True)}
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
    assert refused.headers.get("retry-after") is not None
