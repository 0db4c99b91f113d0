"""``serve run deploy/serve.yaml`` starts its own local cluster, answers, and stops on SIGINT."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from tests.e2e.conftest import free_port, wait_until

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]


def test_serve_run_with_the_shipped_config(tmp_path):
    config = yaml.safe_load((ROOT / "deploy" / "serve.yaml").read_text())
    port, metrics_port = free_port(), free_port()
    config["http_options"]["port"] = port  # only the ports differ from the shipped file
    app = config["applications"][0]
    app["args"]["set"]["metrics.port"] = metrics_port
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a fresh cluster
    log = (tmp_path / "serve.log").open("w")
    serve_bin = Path(sys.executable).with_name("serve")
    # SIGINT at its default in the child (a background job of a non-interactive shell starts
    # with it ignored, and children inherit that), so the Ctrl-C below reaches `serve run`
    proc = subprocess.Popen(
        [str(serve_bin), "run", str(path)],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        base = f"http://127.0.0.1:{port}"

        def ready():
            if proc.poll() is not None:
                text = (tmp_path / "serve.log").read_text()
                raise AssertionError(f"serve run exited early:\n{text[-3000:]}")
            try:
                return httpx.get(f"{base}/v1/models", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, timeout_s=180, interval_s=1.0)
        body = {"model": "qwen3-next-tiny-py", "prompt": "hello", "max_tokens": 4, "temperature": 0}
        out = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
        assert out["usage"]["completion_tokens"] == 4
        assert "hybridserve_" in wait_until(lambda: _metrics_text(metrics_port), timeout_s=30, interval_s=0.5)
    finally:
        # SIGINT to `serve run` alone, as `kill -INT`: it stops Serve and the local cluster
        # it started (sent to the whole group, the fresh GCS and raylet could die first and
        # the shutdown wait on them). A shutdown that still hangs gets a second Ctrl-C, as a
        # user would press, then fails
        try:
            for _ in range(2):
                proc.send_signal(signal.SIGINT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=60)
                    break
            proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        with contextlib.suppress(ProcessLookupError):  # whatever of its cluster is left
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    assert proc.returncode == 0, (tmp_path / "serve.log").read_text()[-3000:]


def _metrics_text(port: int) -> str | None:
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    return text if "hybridserve_generation_tokens_total" in text else None
