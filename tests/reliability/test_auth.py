"""The API key: every route but the health checks (``/health``, ``/ping``) refuses a
missing or wrong key with 401 and an error object, and no key -- right or wrong -- reaches
a log or a response body.

The routes are enumerated, not listed: the deployed app's ``/openapi.json`` (itself
guarded) and, cross-checked against it, the routes of the same app built in process; plus
``/openapi.json``, unknown paths and wrong methods. Logs searched: every file under the
Ray session's log dir (Serve's proxy, controller and replica logs, worker stdout/stderr)
and the Python log records of an in-process app (``caplog`` at DEBUG, every logger).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]
KEY = "sk-auth-5c7e1f0a9b3d4e21"
WRONG_KEYS = ("sk-wrong-8d2f6a41c0e7", "sk-auth-5c7e1f0a9b3d4e2", "sk-auth-5c7e1f0a9b3d4e21x")
MODEL = "tiny-auth"
BODIES = {
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 2},
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/tokenize": {"model": MODEL, "prompt": "hi"},
    "/detokenize": {"model": MODEL, "tokens": [1, 2]},
}
OPEN = {"/health", "/ping"}


def bad_headers() -> list[dict[str, str]]:
    """No key, wrong keys, the right key in the wrong scheme or without one."""
    out: list[dict[str, str]] = [{}]
    out += [{"Authorization": f"Bearer {k}"} for k in WRONG_KEYS]
    out += [
        {"Authorization": KEY},
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": f"Token {KEY}"},
        {"Authorization": "Bearer"},
        {"X-Api-Key": KEY},
    ]
    return out


@pytest.fixture(scope="module")
def app(deployed, tiny_qwen_dir):
    return deployed("authz", str(tiny_qwen_dir), args={"model_name": MODEL}, overrides={"server": {"api_key": KEY}})


@pytest.fixture(scope="module")
def operations(app) -> list[tuple[str, str]]:
    r = httpx.get(f"{app.base_url}/openapi.json", headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    r.raise_for_status()
    ops = [(m.upper(), path) for path, item in r.json()["paths"].items() for m in item]
    assert {p for _, p in ops} >= {
        "/health",
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
        "/flush_cache",
        "/debug/replicas",
    }
    return ops


def concrete(path: str) -> str:
    """A path template with its parameters filled in (``/v1/models/{model_id}``)."""
    return path.replace("{model_id}", MODEL)


def guarded_requests(operations: list[tuple[str, str]], probe: str) -> list[tuple[str, str]]:
    """Every operation but the health checks, the document itself, unknown paths, wrong methods."""
    reqs = [(m, concrete(p)) for m, p in operations if p not in OPEN]
    return reqs + [
        ("GET", "/openapi.json"),
        ("GET", probe),
        ("POST", "/v1/nope"),
        ("GET", "/"),
        ("DELETE", "/v1/models"),
        ("GET", "/v1/completions"),
        ("POST", "/health/x"),
    ]


def assert_401(r: httpx.Response) -> None:
    assert r.status_code == 401, (r.request.method, r.request.url, r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"] == "Bearer"
    for secret in (KEY, *WRONG_KEYS):
        assert secret not in r.text and secret[:12] not in r.text


def test_every_route_but_health_needs_the_key(app, operations):
    probe = f"/v1/probe-{uuid.uuid4().hex}"
    reqs = guarded_requests(operations, probe)
    request_ids: list[str] = []  # Serve logs each request under this id
    with httpx.Client(base_url=app.base_url, timeout=60) as client:
        for method, path in reqs:
            for headers in bad_headers():
                request_ids.append(f"authprobe-{uuid.uuid4().hex}")
                r = client.request(
                    method, path, headers={**headers, "x-request-id": request_ids[-1]}, json=BODIES.get(path)
                )
                assert_401(r)
                assert r.headers.get_list("x-request-id") == [request_ids[-1]]  # once: the proxy echoes it
        assert client.get("/health").status_code == 200
        assert client.get("/ping").status_code == client.post("/ping").status_code == 200
        good = {"Authorization": f"Bearer {KEY}"}
        allowed = {(m, p): client.request(m, p, headers=good, json=BODIES.get(p)).status_code for m, p in reqs}
    for (method, path), status in allowed.items():
        assert status != 401, (method, path)
        if (method, path) in {(m, concrete(p)) for m, p in operations}:
            assert status == 200, (method, path, status)
    assert allowed[("GET", probe)] == 404 and allowed[("DELETE", "/v1/models")] == 405
    print(
        f"\nauth: {len(reqs)} guarded (method, path) pairs x {len(bad_headers())} bad credentials = "
        f"{len(request_ids)} requests, all 401; with the key: {sorted(set(allowed.values()))}"
    )
    _assert_keys_not_in_ray_logs(request_ids)


def _ray_logs_dir() -> Path:
    import ray

    return Path(ray._private.worker._global_node.get_logs_dir_path())  # this session's, not _latest


def _assert_keys_not_in_ray_logs(request_ids: list[str]) -> None:
    """Every log file of this Ray session: each refused request is logged there (so these
    are the right logs, and written), and no key is."""
    logs = _ray_logs_dir()

    def missing() -> list[str]:
        text = b"".join(f.read_bytes() for f in (logs / "serve").glob("*.log"))
        return [rid for rid in request_ids if rid.encode() not in text]

    deadline = time.monotonic() + 30
    while missing():
        assert time.monotonic() < deadline, f"{len(missing())} refused requests in no log under {logs}"
        time.sleep(0.5)
    files = [f for f in logs.rglob("*") if f.is_file()]
    for f in files:
        data = f.read_bytes()
        for secret in (KEY, *WRONG_KEYS):
            assert secret.encode() not in data, f"{secret} in {f}"
    print(f"ray logs: {len(files)} files, {sum(f.stat().st_size for f in files)} bytes, no key")


@pytest.fixture(scope="module")
def local_app(tiny_qwen_dir) -> Iterator[tuple[asyncio.AbstractEventLoop, object]]:
    from cluster.api.http_api import make_api
    from cluster.api.openai_server import OpenAIServer, ServerSettings
    from cluster.serving.engine_client import LocalEngineClient
    from cluster.serving.replica_core import ReplicaCore
    from configs.schema import load_config
    from tests.reliability.conftest import SMALL_ENGINE

    loop = asyncio.new_event_loop()
    config = load_config(overrides={**SMALL_ENGINE, "model": str(tiny_qwen_dir), "server": {"api_key": KEY}})
    core = loop.run_until_complete(ReplicaCore.create(config))
    server = OpenAIServer(
        LocalEngineClient(core), core.loop.engine.tokenizer, ServerSettings(MODEL, str(tiny_qwen_dir), KEY)
    )
    yield loop, make_api(server)
    loop.run_until_complete(core.shutdown())
    loop.close()


def test_in_process_routes_match_the_document_and_log_no_key(local_app, operations, caplog):
    from fastapi.routing import APIRoute

    loop, api = local_app
    routes = {
        (m, re.sub(r":\w+}", "}", r.path))  # /v1/models/{model_id:path} as documented
        for r in api.routes
        if isinstance(r, APIRoute)
        for m in r.methods
    }
    assert routes == set(operations)  # nothing is left out of the document
    caplog.set_level("DEBUG")
    reqs = guarded_requests(operations, "/v1/probe-local")

    async def go() -> list[httpx.Response]:
        out = []
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://t") as c:
            for method, path in reqs:
                for headers in bad_headers():
                    out.append(await c.request(method, path, headers=headers, json=BODIES.get(path)))
            for method, path in reqs:  # good key: through to the engine and back
                good = {"Authorization": f"Bearer {KEY}"}
                out.append(await c.request(method, path, headers=good, json=BODIES.get(path)))
            bad_body = json.dumps({**BODIES["/v1/completions"], "temperature": -1})
            out.append(
                await c.post("/v1/completions", headers={**good, "content-type": "application/json"}, content=bad_body)
            )
            out.append(await c.post("/v1/completions", headers=good, content=bad_body))
        return out

    responses = loop.run_until_complete(go())
    assert sum(r.status_code == 401 for r in responses) == len(reqs) * len(bad_headers())
    assert [r.status_code for r in responses[-2:]] == [400, 415]  # refused; the key not echoed
    text = caplog.text + "".join(r.text + str(r.headers) for r in responses)
    for secret in (KEY, *WRONG_KEYS):
        assert secret not in text
    print(f"\nin process: {len(responses)} requests, {len(caplog.records)} log records, no key")
