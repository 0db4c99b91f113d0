"""``hybridserve bench correctness`` against two loopback servers over the tiny Qwen3-Next
(in-process replicas, no Ray: ``local_app`` of tests/cluster/api, each app served by uvicorn
on 127.0.0.1 on its own event loop's thread): the tested one with everything on (prefix
cache on a page-4 / interval-16 grid, MTP k=3, overlap, small pools, the host tier,
invariant checks), the reference with everything off. The CLI runs as a user runs it, and
finds no divergence in a few hundred requests."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import pytest
import uvicorn

from cluster.cli import main as cli_main
from tests.cluster.api.conftest import App, local_app  # noqa: F401 - the fixture, reused

PAGE, INTERVAL = 4, 16
SCHED = {"max_running_requests": 6, "max_batch_tokens": 256, "chunked_prefill_size": 32}
TESTED = {
    "cache": {
        "page_size": PAGE,
        "mamba_track_interval": INTERVAL,
        "max_kv_tokens": 1024,
        "max_mamba_slots": 20,
        "host_mamba_slots": 16,
        "host_kv_tokens": 1024,
    },
    "scheduler": {**SCHED, "overlap": True},
    "spec": {"method": "mtp", "num_draft_tokens": 3},
    "debug": {"check_invariants": True},
}
REFERENCE = {
    "cache": {"page_size": PAGE, "enable_prefix_cache": False, "max_kv_tokens": 4096, "max_mamba_slots": 32},
    "scheduler": {**SCHED, "overlap": False},
}


class Served:
    """An in-process app on a loopback port: its loop runs in a thread, uvicorn on it."""

    def __init__(self, app: App) -> None:
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app.api, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=app.loop.run_forever, daemon=True)
        self.thread.start()
        self.serving = asyncio.run_coroutine_threadsafe(self.server.serve(), app.loop)
        for _ in range(1000):
            if self.server.started or self.serving.done():
                break
            threading.Event().wait(0.01)
        if not self.server.started:
            raise RuntimeError(
                f"uvicorn did not start: {self.serving.exception() if self.serving.done() else 'timeout'}"
            )

    @property
    def url(self) -> str:
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def counters(self) -> dict:
        """The engine's counters (``EngineStats.snapshot``), read on its loop."""
        return asyncio.run_coroutine_threadsafe(self.app.core.stats("t", "t"), self.app.loop).result(30).counters

    def stop(self) -> None:
        self.server.should_exit = True
        self.serving.result(timeout=30)
        self.app.loop.call_soon_threadsafe(self.app.loop.stop)
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def servers(local_app, tiny_qwen_dir) -> Iterator[tuple[Served, Served]]:  # noqa: F811 - the imported fixture
    tested = Served(local_app(tiny_qwen_dir, **TESTED))
    reference = Served(local_app(tiny_qwen_dir, **REFERENCE))
    yield tested, reference
    for s in (tested, reference):
        s.stop()  # before local_app shuts the replicas down on their (stopped) loops


def run_cli(capsys, *args: str) -> tuple[int, dict]:
    code = cli_main(["bench", "correctness", *args, "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    return code, json.loads(out[-1])


def common(tested: Served, reference: Served, requests: int) -> list[str]:
    return [
        "--url",
        tested.url,
        "--reference-url",
        reference.url,
        "--requests",
        str(requests),
        "--page-size",
        str(PAGE),
        "--track-interval",
        str(INTERVAL),
        "--max-tokens",
        "8",
        "--concurrency",
        "8",
    ]


def test_everything_on_matches_everything_off(servers, capsys):
    tested, reference = servers
    code, r = run_cli(capsys, *common(tested, reference, 240))
    assert (r["requests"], r["compared"], r["errors"]) == (240, 240, 0), r
    assert r["prompt_format"] == "ids" and r["unit"] == "token", r
    assert r["divergent"] == 0 and r["malformed_json"] == 0 and r["divergences"] == [], r
    assert r["json_requests"] > 0 and code == 0
    assert 0 < r["tested_cached_tokens"] < r["tested_prompt_tokens"], r
    # What the tested server did: served prompts from the device and host tiers, drafted
    # with MTP, overlapped steps, and broke no invariant.
    stats = tested.counters()
    assert stats["hybridserve_cache_hits_total"].get("device", 0) > 0, stats
    assert stats["hybridserve_cache_hits_total"].get("host", 0) > 0, stats
    assert stats["hybridserve_spec_draft_tokens_total"] > 0 and stats["hybridserve_overlapped_steps_total"] > 0
    assert stats["hybridserve_invariant_checks_total"] > 0 and stats["hybridserve_invariant_violations_total"] == {}


# The combination that broke SGLang: lazy checkpoints, MTP, overlap, page 1, a small slot pool
# and half the pending-slot allocations failing. With the alias guard off, keep slots that an
# in-flight verify writes are donated, and prompts that reuse them diverge.
ALIASING = {
    "cache": {
        "page_size": 1,
        "mamba_strategy": "extra_buffer_lazy",
        "mamba_track_interval": INTERVAL,
        "max_kv_tokens": 2048,
        "max_mamba_slots": 24,
    },
    "scheduler": {"max_running_requests": 4, "max_batch_tokens": 256, "chunked_prefill_size": 32, "overlap": True},
    "spec": {"method": "mtp", "num_draft_tokens": 2},
}


@pytest.mark.parametrize("guard", [True, False], ids=["guard_on", "guard_off"])
def test_the_alias_guard_off_is_caught(local_app, tiny_qwen_dir, servers, capsys, guard):  # noqa: F811
    _, reference = servers
    debug = {"disable_alias_guard": not guard, "fail_pending_alloc_prob": 0.5}
    tested = Served(local_app(tiny_qwen_dir, **ALIASING, debug=debug))
    try:
        args = common(tested, reference, 120)
        args[args.index("--page-size") + 1] = "1"
        code, r = run_cli(capsys, *args)
    finally:
        tested.stop()
    assert r["errors"] == 0, r
    if guard:
        assert code == 0 and r["divergent"] == 0, r
    else:
        assert code == 1 and r["divergent"] > 0 and r["divergences"], r
        assert all(d["unit"] == "token" and d["expected"] != d["got"] for d in r["divergences"])
