"""Soak load: every shipped workload mixed, streaming and not, with disconnects and invalid requests.

The command line (a checked soak against a running server) is ``tests.reliability.run_soak``.

``concurrency`` workers run a closed loop for ``duration_s``: each takes the next session
of a workload drawn at random (``configs/workloads``: random lengths, shared prefix,
prefix repetition, cache pressure, multi-turn; when a workload's sessions run out it is
rebuilt with the next seed) and sends its turns in order. A fraction ``invalid_frac`` of
the requests is invalid (``INVALID_KINDS`` in turn; each must come back as that 4xx with
an OpenAI error object), a fraction ``disconnect_frac`` is a stream the client closes
after 1-3 content chunks -- both spread evenly over the run (``WorkloadMix.mode``) -- and
of the rest a fraction ``stream_frac`` streams, the others are plain JSON requests. A
request that gives no answer (invalid, disconnected, failed) ends its session.

Every request is bounded by ``request_timeout_s`` (a hang is a ``timeout`` failure). A
completed request must carry exactly ``max_tokens`` output tokens (``ignore_eos``), and a
stream must end with ``[DONE]`` and no in-band error. Outcomes: ``ok``, ``disconnected``,
``rejected`` (an invalid request refused as expected) and the failures in ``FAILURES``.
Server-side checks (violations, pools, RSS) are in ``tests.reliability.soak_server``.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cluster.bench.client import Target, _content, _Conversation, _payload, _Reply, sse_payload
from cluster.bench.metrics import RequestRecord
from cluster.bench.workloads import Renderer, Session, Workload, load_workload

WORKLOADS = ("random", "shared_prefix", "prefix_repetition", "cache_pressure", "multi_turn")
# cache_pressure needs a tenant count (it is derived from the cluster's cache otherwise)
DEFAULT_OVERRIDES: dict[str, dict[str, Any]] = {"cache_pressure": {"num_tenants": 8}}
FAILURES = (
    "http_5xx",
    "http_4xx",
    "wrong_4xx",
    "bad_error_object",
    "invalid_accepted",
    "stream_error",
    "truncated",
    "wrong_length",
    "transport",
    "timeout",
)
INVALID_KINDS: dict[str, tuple[int, ...]] = {  # kind -> accepted statuses
    "max_tokens_negative": (400,),
    "negative_temperature": (400,),
    "top_p_above_one": (400,),
    "n_over_cap": (400,),
    "unknown_model": (404,),
    "prompt_too_long": (400,),
    "malformed_json": (400,),
}


@dataclass(frozen=True)
class SoakSettings:
    duration_s: float = 600.0  # load time in all, warm-up included
    warmup_s: float = 60.0  # ``on_warm`` is called this long after the start
    concurrency: int = 8
    stream_frac: float = 0.5
    disconnect_frac: float = 0.05
    invalid_frac: float = 0.01
    request_timeout_s: float = 120.0
    seed: int = 0
    workloads: tuple[str, ...] = WORKLOADS
    overrides: dict[str, dict[str, Any]] = field(default_factory=lambda: dict(DEFAULT_OVERRIDES))

    def __post_init__(self) -> None:
        fracs = {
            "stream_frac": self.stream_frac,
            "disconnect_frac": self.disconnect_frac,
            "invalid_frac": self.invalid_frac,
        }
        if any(not 0.0 <= v <= 1.0 for v in fracs.values()) or self.disconnect_frac + self.invalid_frac > 1.0:
            raise ValueError(f"fractions must lie in [0, 1], disconnect + invalid <= 1; got {fracs}")
        if self.duration_s <= 0 or not 0 <= self.warmup_s < self.duration_s:
            raise ValueError(f"need 0 <= warmup_s < duration_s, got {self.warmup_s}, {self.duration_s}")
        if self.concurrency < 1 or self.request_timeout_s <= 0 or not self.workloads:
            raise ValueError(
                f"concurrency ({self.concurrency}) >= 1, request_timeout_s "
                f"({self.request_timeout_s}) > 0 and a workload are needed"
            )


@dataclass(frozen=True)
class SoakRecord:
    """One request: ``mode`` is plain | stream | disconnect | invalid:<kind>."""

    workload: str
    mode: str
    outcome: str
    status: int | None
    start_s: float  # since the soak's start
    latency_s: float
    detail: str = ""  # what went wrong, and the request, for a failure


@dataclass
class SoakReport:
    records: list[SoakRecord]
    duration_s: float
    model: str

    def failures(self) -> list[SoakRecord]:
        return [r for r in self.records if r.outcome in FAILURES]

    def counts(self, key: Callable[[SoakRecord], Any]) -> dict[Any, int]:
        return dict(sorted(Counter(key(r) for r in self.records).items(), key=lambda kv: str(kv[0])))

    def figures(self) -> dict[str, Any]:
        """Requests by workload and mode, statuses, outcomes, latency of the completed ones (s)."""
        done = sorted(r.latency_s for r in self.records if r.outcome == "ok")
        return {
            "duration_s": round(self.duration_s, 1),
            "requests": len(self.records),
            "by_workload": self.counts(lambda r: r.workload),
            "by_mode": self.counts(lambda r: r.mode.split(":")[0]),
            "by_workload_and_mode": self.counts(lambda r: f"{r.workload}/{r.mode.split(':')[0]}"),
            "invalid_kinds": dict(Counter(r.mode[8:] for r in self.records if r.mode.startswith("invalid:"))),
            "statuses": self.counts(lambda r: r.status),
            "outcomes": self.counts(lambda r: r.outcome),
            "e2e_p50_s": round(done[len(done) // 2], 3) if done else None,
            "e2e_max_s": round(done[-1], 3) if done else None,
        }


# -- the mix ----------------------------------------------------------------------------------
class WorkloadMix:
    """An endless, seeded source of (workload, session): a workload at random, its next session."""

    def __init__(self, settings: SoakSettings) -> None:
        self._settings = settings
        self._rng = random.Random(settings.seed)
        self._epochs = {name: 0 for name in settings.workloads}
        self._queues: dict[str, list[Session]] = {name: [] for name in settings.workloads}
        self._built: dict[str, Workload] = {}
        self._phases = (self._rng.random(), self._rng.random())
        self._kinds = sorted(INVALID_KINDS)
        self._rng.shuffle(self._kinds)
        self._num_sent = self._num_invalid = 0

    def next(self) -> tuple[Workload, Session]:
        name = self._rng.choice(self._settings.workloads)
        if not self._queues[name]:
            overrides = {**self._settings.overrides.get(name, {}), "seed": self._settings.seed + self._epochs[name]}
            self._epochs[name] += 1
            self._built[name] = load_workload(name, overrides)
            self._queues[name] = list(reversed(self._built[name].sessions))
        return self._built[name], self._queues[name].pop()

    def mode(self) -> str:
        """The next request's mode. Invalid and disconnected requests are spread evenly: the
        n-th request is one when ``floor(frac * n + phase)`` steps, so over any window of
        ``1 / frac`` requests exactly one is (a seeded phase picks which; disconnects count
        over the valid requests); invalid kinds take turns."""
        n, s = self._num_sent, self._settings
        self._num_sent += 1
        if _steps(s.invalid_frac, n, self._phases[0]):
            kind = self._kinds[self._num_invalid % len(self._kinds)]
            self._num_invalid += 1
            return f"invalid:{kind}"
        n_valid = n - self._num_invalid  # disconnects are spread over the valid ones
        if _steps(s.disconnect_frac, n_valid, self._phases[1]):
            return "disconnect"
        return "stream" if self._rng.random() < s.stream_frac else "plain"


def _steps(frac: float, n: int, phase: float) -> bool:
    return math.floor(frac * (n + 1) + phase) > math.floor(frac * n + phase)


# -- one request ------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Server:
    target: Target
    model: str
    max_model_len: int
    path_of: dict[str, str]  # workload api -> URL


class _Outcome(Exception):
    """Ends a request with an outcome (raised from inside the send)."""

    def __init__(self, outcome: str, status: int | None, detail: str = "") -> None:
        super().__init__(detail)
        self.outcome, self.status, self.detail = outcome, status, detail


def invalid_body(kind: str, body: dict[str, Any], max_model_len: int) -> dict[str, Any] | bytes:
    """``body`` made invalid in the way ``kind`` names (bytes: not JSON at all)."""
    if kind == "max_tokens_negative":  # (0 is valid for completions with echo)
        return {**body, "max_tokens": -1}
    if kind == "negative_temperature":
        return {**body, "temperature": -1.0}
    if kind == "top_p_above_one":
        return {**body, "top_p": 1.5}
    if kind == "n_over_cap":
        return {**body, "n": 10_000}
    if kind == "unknown_model":
        return {**body, "model": "no-such-model"}
    if kind == "prompt_too_long":
        if "messages" in body:
            return {**body, "messages": [{"role": "user", "content": "word " * (2 * max_model_len)}]}
        return {**body, "prompt": [17] * (max_model_len + 8)}
    if kind == "malformed_json":
        return json.dumps(body).encode()[:-2]
    raise ValueError(f"unknown invalid kind {kind!r}; known: {sorted(INVALID_KINDS)}")


async def _invalid(client: Any, url: str, server: _Server, kind: str, body: dict[str, Any]) -> int:
    bad = invalid_body(kind, body, server.max_model_len)
    content = bad if isinstance(bad, bytes) else json.dumps(bad).encode()
    headers = {**server.target.headers(), "content-type": "application/json"}
    r = await client.post(url, content=content, headers=headers)
    if r.status_code == 200:
        raise _Outcome("invalid_accepted", 200, r.text[:200])
    try:
        err = r.json()["error"]
        ok_object = bool(err["message"]) and {"type", "param", "code"} <= set(err)
    except (ValueError, KeyError, TypeError):
        ok_object = False
    if r.status_code >= 500:
        raise _Outcome("http_5xx", r.status_code, r.text[:300])
    if not ok_object:
        raise _Outcome("bad_error_object", r.status_code, r.text[:300])
    if r.status_code not in INVALID_KINDS[kind]:
        raise _Outcome("wrong_4xx", r.status_code, r.text[:300])
    return r.status_code


def _check_status(status: int, text: str) -> None:
    if status >= 500:
        raise _Outcome("http_5xx", status, text[:300])
    if status != 200:
        raise _Outcome("http_4xx", status, text[:300])


async def _plain(
    client: Any, url: str, server: _Server, workload: Workload, body: dict[str, Any]
) -> tuple[str, list[int]]:
    body = {**body, "stream": False}
    body.pop("stream_options", None)
    r = await client.post(url, json=body, headers=server.target.headers())
    _check_status(r.status_code, r.text)
    obj = r.json()
    choice = obj["choices"][0]
    got = int(obj["usage"]["completion_tokens"])
    if got != body["max_tokens"]:
        raise _Outcome("wrong_length", 200, f"{got} tokens, asked {body['max_tokens']}")
    text = choice["message"]["content"] if workload.api == "chat" else choice["text"]
    return text or "", list(choice.get("token_ids") or [])


async def _stream(
    client: Any, url: str, server: _Server, workload: Workload, body: dict[str, Any], cut_after: int | None
) -> tuple[str, list[int]]:
    """Read the SSE stream; with ``cut_after``, close it after that many content chunks."""
    parts: list[str] = []
    ids: list[int] = []
    num_chunks, usage, done = 0, None, False
    async with client.stream("POST", url, json=body, headers=server.target.headers()) as r:
        if r.status_code != 200:
            _check_status(r.status_code, (await r.aread()).decode(errors="replace"))
        async for line in r.aiter_lines():
            obj = sse_payload(line)
            if obj is None:
                continue
            if not isinstance(obj, dict):  # [DONE]
                done = True
                break
            if obj.get("error"):
                raise _Outcome("stream_error", 200, json.dumps(obj["error"])[:300])
            for choice in obj.get("choices") or []:
                text, new_ids = _content(workload, choice)
                if text or new_ids:
                    num_chunks += 1
                    parts.append(text)
                    ids.extend(new_ids)
            usage = obj.get("usage") or usage
            if cut_after is not None and num_chunks >= cut_after:
                raise _Outcome("disconnected", 200)  # leaving the block closes the stream
    if not done or usage is None:
        raise _Outcome("truncated", 200, f"done={done}, usage={usage}, {num_chunks} chunks")
    if int(usage["completion_tokens"]) != body["max_tokens"]:
        raise _Outcome("wrong_length", 200, f"{usage['completion_tokens']} tokens, asked {body['max_tokens']}")
    return "".join(parts), ids


async def _request(
    client: Any, server: _Server, workload: Workload, body: dict[str, Any], mode: str, rng: random.Random
) -> tuple[str, int | None, str, tuple[str, list[int]] | None]:
    """(outcome, status, detail, answer): the answer only for a completed request."""
    url = server.path_of[workload.api]
    try:
        if mode.startswith("invalid:"):
            body = {**body, "stream": rng.random() < 0.5}  # errors come before any stream
            return "rejected", await _invalid(client, url, server, mode[8:], body), "", None
        if mode == "plain":
            return "ok", 200, "", await _plain(client, url, server, workload, body)
        cut_after = rng.randint(1, 3) if mode == "disconnect" else None
        return "ok", 200, "", await _stream(client, url, server, workload, body, cut_after)
    except _Outcome as out:
        return out.outcome, out.status, out.detail, None
    except Exception as exc:  # noqa: BLE001 - a transport failure is data, not a crash
        return "transport", None, f"{type(exc).__name__}: {exc}"[:300], None


# -- the loop ---------------------------------------------------------------------------------
async def _worker(
    client: Any,
    server: _Server,
    mix: WorkloadMix,
    renderers: dict[str, Renderer],
    settings: SoakSettings,
    t0: float,
    out: list[SoakRecord],
    worker_id: int,
) -> None:
    rng = random.Random(settings.seed * 1000 + worker_id)
    deadline = t0 + settings.duration_s
    while time.perf_counter() < deadline:
        workload, session = mix.next()
        conv = _Conversation(workload, session, renderers[workload.prompt_format])
        for k, turn in enumerate(session.turns):
            if time.perf_counter() >= deadline:
                break
            prompt, _ = conv.prompt(k)
            body = _payload(workload, server.model, server.target, prompt, turn.max_tokens)
            mode, start = mix.mode(), time.perf_counter()
            try:
                outcome, status, detail, answer = await asyncio.wait_for(
                    _request(client, server, workload, body, mode, rng), settings.request_timeout_s
                )
            except asyncio.TimeoutError:
                outcome, status, detail, answer = "timeout", None, f"> {settings.request_timeout_s}s", None
            if outcome in FAILURES:
                detail = f"{detail} | request: {json.dumps(body)[:400]}"
            out.append(
                SoakRecord(workload.name, mode, outcome, status, start - t0, time.perf_counter() - start, detail)
            )
            if answer is None:
                break  # later turns need this answer
            conv.answer(_Reply(RequestRecord(True, start), answer[0], answer[1]))


async def _server_info(client: Any, target: Target) -> _Server:
    r = await client.get(f"{target.v1}/models", headers=target.headers())
    r.raise_for_status()
    entry = r.json()["data"][0]
    paths = {"completions": f"{target.v1}/completions", "chat": f"{target.v1}/chat/completions"}
    return _Server(target, target.model or entry["id"], int(entry.get("max_model_len") or 4096), paths)


async def run_soak(
    target: Target, settings: SoakSettings, renderer: Renderer | None = None, on_warm: Callable[[], None] | None = None
) -> SoakReport:
    """Run the mixed load; ``on_warm`` runs (in a thread) ``warmup_s`` after the start."""
    import httpx

    timeout = httpx.Timeout(settings.request_timeout_s, connect=30.0)
    limits = httpx.Limits(max_connections=settings.concurrency + 2)
    records: list[SoakRecord] = []
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        server = await _server_info(client, target)
        renderers = {"ids": Renderer(), "text": renderer or Renderer()}
        mix = WorkloadMix(settings)
        t0 = time.perf_counter()
        workers = [
            asyncio.create_task(_worker(client, server, mix, renderers, settings, t0, records, i))
            for i in range(settings.concurrency)
        ]
        try:
            if on_warm is not None:
                await asyncio.sleep(settings.warmup_s)
                await asyncio.to_thread(on_warm)
            await asyncio.gather(*workers)
        finally:
            for task in workers:
                task.cancel()
        duration = time.perf_counter() - t0
    return SoakReport(records, duration, server.model)
