"""``hybridserve bench``'s load client: streaming OpenAI requests on an open-loop schedule.

Any OpenAI-compatible server: ``/v1/completions`` (token-id or text prompts) or
``/v1/chat/completions``, always ``stream: true`` with ``stream_options.include_usage``
(token counts and ``cached_tokens`` come from the usage chunk), ``temperature: 0`` and
``ignore_eos: true`` (vLLM and SGLang extensions; set ``ignore_eos=False`` for a server
that rejects it).

Load model (vLLM's): sessions arrive at the times of ``arrival_times`` -- gamma gaps of
shape ``burstiness`` (1 = Poisson) at ``rate`` per second, rescaled so the schedule spans
exactly ``n / rate`` seconds; ``rate = inf`` sends everything at once. A semaphore caps
requests in flight at ``max_concurrency``; a request's clock starts when it is sent, after
the semaphore. A multi-turn session sends turn k+1 when turn k has finished (its prompt
holds turn k's answer). Warm-up sessions run first, unmeasured, at full speed.

Timings per request (``metrics.RequestRecord``): TTFT at the first chunk with content,
ITL between content chunks, E2EL at the end of the stream; see ``metrics`` for the rest.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cluster.bench.metrics import BenchMetrics, RequestRecord, compute_metrics
from cluster.bench.workloads import Renderer, Session, Workload


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (s from the start) of ``n`` arrivals; all 0.0 for an infinite rate."""
    if n <= 0:
        return []
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"rate and burstiness must be positive, got rate={rate}, burstiness={burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)  # gamma(shape k, scale theta) has mean 1 / rate
    times, t = [], 0.0
    for _ in range(n):
        t += rng.gammavariate(burstiness, theta)
        times.append(t)
    scale = (n / rate) / times[-1]  # vLLM: the schedule lasts exactly n / rate
    return [x * scale for x in times]


@dataclass(frozen=True)
class Target:
    base_url: str  # e.g. http://127.0.0.1:8000 or .../v1
    model: str | None = None  # None: the first id of /v1/models
    api_key: str | None = None
    ignore_eos: bool = True
    timeout_s: float = 600.0

    @property
    def v1(self) -> str:
        url = self.base_url.rstrip("/")
        return url if url.endswith("/v1") else f"{url}/v1"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True)
class LoadSettings:
    rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    slos_ms: dict[str, float] = field(default_factory=dict)
    percentiles: tuple[float, ...] = (99,)


@dataclass(frozen=True)
class RecordLabel:
    session_id: int
    turn: int
    group: str


@dataclass
class BenchResult:
    workload: str
    model: str
    records: list[RequestRecord]
    labels: list[RecordLabel]
    duration_s: float
    metrics: BenchMetrics


@dataclass
class _Reply:
    record: RequestRecord
    text: str
    token_ids: list[int]


async def _models(client: Any, target: Target) -> dict[str, Any]:
    r = await client.get(f"{target.v1}/models", headers=target.headers())
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise ValueError(f"{target.v1}/models lists no model")
    return data[0]


def _payload(workload: Workload, model: str, target: Target, prompt: Any, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.ignore_eos:
        body["ignore_eos"] = True
    if workload.api == "chat":
        body["messages"] = prompt
    else:
        body["prompt"] = prompt
        if workload.prompt_format == "ids" and any(len(s.turns) > 1 for s in workload.sessions):
            body["return_token_ids"] = True  # the next turn's prompt holds these ids
    return body


DONE = "[DONE]"


def sse_payload(line: str) -> dict[str, Any] | str | None:
    """One line of an SSE stream: its JSON object, ``DONE`` for ``data: [DONE]``, None for a
    line that is not data; ValueError for data that is not a JSON object."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == DONE:
        return DONE
    obj = json.loads(data)
    if not isinstance(obj, dict):
        raise ValueError(f"SSE data is not a JSON object: {data[:80]!r}")
    return obj


def _content(workload: Workload, choice: dict[str, Any]) -> tuple[str, list[int]]:
    return choice_content(workload.api, choice)


def choice_content(api: str, choice: dict[str, Any]) -> tuple[str, list[int]]:
    """The text and token ids one stream choice carries."""
    if api == "chat":
        text = (choice.get("delta") or {}).get("content") or ""
    else:
        text = choice.get("text") or ""
    return text, list(choice.get("token_ids") or [])


async def _send(client: Any, target: Target, workload: Workload, body: dict[str, Any], prompt_len_hint: int) -> _Reply:
    path = "chat/completions" if workload.api == "chat" else "completions"
    start = time.perf_counter()
    ttft, last, itl = 0.0, 0.0, []
    text_parts: list[str] = []
    token_ids: list[int] = []
    usage: dict[str, Any] | None = None
    num_chunks = 0
    try:
        async with client.stream("POST", f"{target.v1}/{path}", json=body, headers=target.headers()) as r:
            if r.status_code != 200:
                raw = (await r.aread()).decode(errors="replace")
                return _Reply(RequestRecord(False, start, error=f"HTTP {r.status_code}: {raw[:300]}"), "", [])
            async for line in r.aiter_lines():
                obj = sse_payload(line)
                if obj is None:
                    continue
                if not isinstance(obj, dict):
                    break  # [DONE]
                if obj.get("error"):
                    raise RuntimeError(f"stream error: {obj['error']}")
                now = time.perf_counter()
                for choice in obj.get("choices") or []:
                    text, ids = _content(workload, choice)
                    if not (text or ids):
                        continue
                    if num_chunks == 0:
                        ttft = now - start
                    else:
                        itl.append(now - last)
                    last = now
                    num_chunks += 1
                    text_parts.append(text)
                    token_ids.extend(ids)
                if obj.get("usage"):
                    usage = obj["usage"]
        end = time.perf_counter()
    except Exception as exc:  # noqa: BLE001 - a failed request is data, not a crash
        return _Reply(RequestRecord(False, start, error=f"{type(exc).__name__}: {exc}"[:300]), "", [])
    if num_chunks == 0:
        return _Reply(RequestRecord(False, start, error="no content in the stream"), "", [])
    usage = usage or {}
    details = usage.get("prompt_tokens_details") or {}
    record = RequestRecord(
        True,
        start,
        ttft,
        end - start,
        tuple(itl),
        prompt_tokens=int(usage.get("prompt_tokens") or prompt_len_hint),
        output_tokens=int(usage.get("completion_tokens") or len(token_ids) or num_chunks),
        cached_tokens=int(details.get("cached_tokens") or 0),
    )
    return _Reply(record, "".join(text_parts), token_ids)


class _Conversation:
    """The growing prompt of one session, in the workload's API format."""

    def __init__(self, workload: Workload, session: Session, renderer: Renderer) -> None:
        self.workload, self.session, self.renderer = workload, session, renderer
        self.ids: list[int] = list(session.shared_ids)
        self.text = renderer.text(session.shared_ids) if workload.prompt_format == "text" else ""
        self.messages: list[dict[str, str]] = []
        if workload.api == "chat" and session.shared_ids:
            self.messages.append({"role": "system", "content": self.text})

    def prompt(self, turn: int) -> tuple[Any, int]:
        """The prompt of ``turn`` (after every earlier answer was added) and its length hint."""
        user = self.session.turns[turn].user_ids
        self.ids += user
        if self.workload.api == "chat":
            self.messages.append({"role": "user", "content": self.renderer.text(user)})
            return list(self.messages), len(self.ids)
        if self.workload.prompt_format == "text":
            self.text += self.renderer.text(user)
            return self.text, len(self.ids)
        return list(self.ids), len(self.ids)

    def answer(self, reply: _Reply) -> None:
        self.ids += reply.token_ids
        self.text += reply.text
        if self.workload.api == "chat":
            self.messages.append({"role": "assistant", "content": reply.text})


async def _run_sessions(
    client: Any,
    target: Target,
    workload: Workload,
    model: str,
    sessions: Sequence[Session],
    times: Sequence[float],
    renderer: Renderer,
    limit: asyncio.Semaphore | None,
    on_done: Callable[[int], None] | None,
) -> list[tuple[RecordLabel, RequestRecord]]:
    t0 = time.perf_counter()
    out: list[tuple[RecordLabel, RequestRecord]] = []

    async def one(session: Session, at: float) -> None:
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        conv = _Conversation(workload, session, renderer)
        for k, turn in enumerate(session.turns):
            prompt, hint = conv.prompt(k)
            body = _payload(workload, model, target, prompt, turn.max_tokens)
            if limit is not None:
                async with limit:
                    reply = await _send(client, target, workload, body, hint)
            else:
                reply = await _send(client, target, workload, body, hint)
            out.append((RecordLabel(session.session_id, k, session.group), reply.record))
            if on_done is not None:
                on_done(len(out))
            if not reply.record.success:
                return  # later turns need this answer
            conv.answer(reply)

    await asyncio.gather(*(one(s, at) for s, at in zip(sessions, times)))
    return out


async def run_benchmark(
    target: Target,
    workload: Workload,
    load: LoadSettings = LoadSettings(),
    renderer: Renderer | None = None,
    on_done: Callable[[int], None] | None = None,
) -> BenchResult:
    """Run the warm-up sessions, then the measured ones; metrics over the measured ones."""
    import httpx

    if load.max_concurrency is not None and load.max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {load.max_concurrency}")
    limits = httpx.Limits(max_connections=load.max_concurrency, max_keepalive_connections=load.max_concurrency)
    timeout = httpx.Timeout(target.timeout_s, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        model = target.model or (await _models(client, target))["id"]
        renderer = renderer or Renderer()
        limit = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
        if workload.warmup:
            warm = await _run_sessions(
                client, target, workload, model, workload.warmup, [0.0] * len(workload.warmup), renderer, limit, None
            )
            bad = [r.error for _, r in warm if not r.success]
            if bad:
                raise RuntimeError(f"{len(bad)} warm-up requests failed, first: {bad[0]}")
        times = arrival_times(len(workload.sessions), load.rate, load.burstiness, load.seed)
        start = time.perf_counter()
        done = await _run_sessions(client, target, workload, model, workload.sessions, times, renderer, limit, on_done)
        duration = time.perf_counter() - start
    done.sort(key=lambda lr: (lr[0].session_id, lr[0].turn))
    labels = [lab for lab, _ in done]
    records = [rec for _, rec in done]
    metrics = compute_metrics(records, duration, load.slos_ms, load.percentiles)
    return BenchResult(workload.name, model, records, labels, duration, metrics)


def resolve_model(target: Target) -> dict[str, Any]:
    """``/v1/models``' first entry (id, and ``root`` when the server tells it)."""
    import httpx

    async def go() -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=30.0, trust_env=False) as client:
            return await _models(client, target)

    return asyncio.run(go())
