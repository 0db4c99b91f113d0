"""``bench correctness`` against fake greedy servers (no model): a deterministic byte-level
"model" whose one corrupted token, near tie or broken JSON the comparison must find exactly
where it is, and the weaker forms it falls back to (text prompts, text comparison)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import zlib
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from cluster.bench.client import Target
from cluster.bench.correctness import check
from cluster.bench.correctness_workload import WorkloadSettings
from cluster.cli import main as cli_main

JSON_REST = '"a": 1}}</tool_call>'
ALT_NEAR, ALT_FAR = 1, 9  # offsets of the runner-up (a near tie) and a token outside the top 5


class FakeGreedy:
    """Token ids are bytes (prompt ids modulo 256); the output continues a prompt's opened tool call with
    ``JSON_REST``, else is letters drawn from the prompt's CRC. ``corrupt``: the first
    response of more than 2 tokens (the probes have 2) is altered at output position 1: a
    'far' token, the 'near' runner-up, or a 'json' object's quote. ``ids``: token-id
    prompts taken; ``logprobs``: logprobs returned."""

    def __init__(self, corrupt: str | None = None, ids: bool = True, logprobs: bool = True) -> None:
        self.corrupt, self.ids, self.logprobs = corrupt, ids, logprobs
        self.corrupted = 0
        self.requests = 0
        self._lock = threading.Lock()
        app = Starlette(
            routes=[
                Route("/v1/models", self.models),
                Route("/v1/completions", self.complete, methods=["POST"]),
                Route("/tokenize", self.tokenize, methods=["POST"]),
            ]
        )
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FakeGreedy:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert time.monotonic() < deadline, "fake server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

    async def models(self, request: Request) -> JSONResponse:
        return JSONResponse({"data": [{"id": "fake", "object": "model"}]})

    async def tokenize(self, request: Request) -> JSONResponse:
        if not self.ids:
            return JSONResponse({"error": {"message": "no"}}, status_code=404)
        return JSONResponse({"tokens": list((await request.json())["prompt"].encode())})

    async def complete(self, request: Request) -> JSONResponse:
        body = await request.json()
        prompt = body["prompt"]
        if isinstance(prompt, list) and not self.ids:
            return JSONResponse({"error": {"message": "token-id prompts are not supported"}}, status_code=400)
        data = bytes(t % 256 for t in prompt) if isinstance(prompt, list) else prompt.encode()
        out = greedy(data, int(body["max_tokens"]))
        with self._lock:
            self.requests += 1
            alter = self.corrupt is not None and self.corrupted == 0 and len(out) > 2  # not a probe
            alter = alter and (self.corrupt != "json" or b"<tool_call>" in data)
            self.corrupted += alter
        tops = [_top(t) for t in out]
        if alter:
            out[1] = {"far": _alt(out[1], ALT_FAR), "near": _alt(out[1], ALT_NEAR), "json": ord('"')}[self.corrupt]
        text = bytes(out).decode()
        choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": "length"}
        if self.logprobs and body.get("logprobs"):
            choice["logprobs"] = {
                "tokens": [f"token_id:{t}" for t in out],
                "token_logprobs": [tops[i].get(f"token_id:{t}", -9.0) for i, t in enumerate(out)],
                "top_logprobs": tops,
                "text_offset": list(range(len(out))),
            }
        return JSONResponse({"choices": [choice]})


def greedy(prompt: bytes, n: int) -> list[int]:
    if b"<tool_call>" in prompt:
        return list(JSON_REST.encode()[:n])
    crc = zlib.crc32(prompt)
    return [97 + (crc + 7 * j) % 26 for j in range(n)]


def _alt(token: int, k: int) -> int:
    return 97 + (token - 97 + k) % 26 if 97 <= token < 123 else token + k


def _top(token: int) -> dict[str, float]:
    """The chosen token best, its runner-up 0.05 nats below, three more far below (five)."""
    top = {f"token_id:{token}": -0.5, f"token_id:{_alt(token, ALT_NEAR)}": -0.55}
    top.update({f"token_id:{_alt(token, k)}": -4.0 - k for k in (2, 3, 4)})
    return top


SETTINGS = WorkloadSettings(requests=60, seed=3, page_size=4, track_interval=16, max_tokens=8, json_max_tokens=32)


def run_check(tested: FakeGreedy, reference: FakeGreedy, near_tie: float | None = None, **kw: Any):
    return asyncio.run(check(Target(tested.url), Target(reference.url), SETTINGS, 4, near_tie=near_tie, **kw))


def test_identical_servers_agree():
    with FakeGreedy() as tested, FakeGreedy() as reference:
        r = run_check(tested, reference)
    assert r.ok and (r.requests, r.compared, r.divergent, r.errors) == (60, 60, 0, 0), r
    assert (r.prompt_format, r.unit) == ("ids", "token")
    assert r.json_requests > 0 and r.json_reference_parsed == r.json_requests and r.malformed_json == 0


def test_one_corrupted_token_is_found_where_it_is(capsys):
    with FakeGreedy(corrupt="far") as tested, FakeGreedy() as reference:
        args = "--requests 60 --seed 3 --page-size 4 --track-interval 16 --max-tokens 8 --concurrency 4".split()
        code = cli_main(["bench", "correctness", "--url", tested.url, "--reference-url", reference.url, *args])
        assert tested.corrupted == 1
    out = capsys.readouterr().out
    assert code == 1 and "divergent        1\n" in out and "FAILED" in out, out
    line = next(x for x in out.splitlines() if "diverged:" in x)
    assert "at token 1:" in line, line


def test_a_near_tie_is_forgiven_only_with_near_tie():
    with FakeGreedy(corrupt="near") as tested, FakeGreedy() as reference:
        exact = run_check(tested, reference)
    with FakeGreedy(corrupt="near") as tested, FakeGreedy() as reference:
        loose = run_check(tested, reference, near_tie=0.1)
    with FakeGreedy(corrupt="near") as tested, FakeGreedy() as reference:
        tight = run_check(tested, reference, near_tie=0.01)
    assert exact.divergent == 1 and exact.divergences[0].position == 1 and exact.near_ties == 0
    assert loose.ok and loose.divergent == 0 and loose.near_ties == 1
    assert tight.divergent == 1 and tight.near_ties == 0
    with FakeGreedy(corrupt="far") as tested, FakeGreedy() as reference:
        far = run_check(tested, reference, near_tie=10.0)  # in no top 5: never forgiven
    assert far.divergent == 1 and far.near_ties == 0


def test_broken_json_is_counted():
    with FakeGreedy(corrupt="json") as tested, FakeGreedy() as reference:
        r = run_check(tested, reference)
    assert (r.malformed_json, r.divergent) == (1, 1) and not r.ok, r


@pytest.mark.parametrize("ids, logprobs, unit", [(False, True, "token"), (False, False, "char")])
def test_weaker_servers_fall_back(ids, logprobs, unit):
    with FakeGreedy(corrupt="far", ids=ids, logprobs=logprobs) as tested, FakeGreedy(ids=ids) as reference:
        r = run_check(tested, reference)
    assert (r.prompt_format, r.unit, r.requests, r.errors) == ("text", unit, 60, 0), r
    assert r.divergent == 1 and r.notes, r
    assert r.divergences[0].position == 1


def test_prompt_format_ids_is_refused_by_a_text_only_server():
    with FakeGreedy(ids=False) as tested, FakeGreedy(ids=False) as reference:
        with pytest.raises(ValueError, match="--prompt-format ids: no /tokenize"):
            run_check(tested, reference, prompt_format="ids")


def test_an_unreachable_server_is_a_clear_error(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    with FakeGreedy() as reference:
        code = cli_main(["bench", "correctness", "--url", closed, "--reference-url", reference.url])
    assert code == 2 and f"{closed}/v1/models: ConnectError" in capsys.readouterr().err
    assert cli_main(["bench", "correctness", "--url", closed]) == 2
    assert "--reference-url" in capsys.readouterr().err
