"""The HTTP side of ``hybridserve bench correctness``: what both servers can do, the prompts
in that form, and every step of every session sent to both.

Requests are non-streaming ``/v1/completions`` at temperature 0 with ``logprobs: 5`` and
``return_tokens_as_token_ids`` (vLLM's extension, ours too; a server that ignores it gives
token strings). Prompts are token ids where both servers take them, the server under test
tokenizes the workload's text (``/tokenize``, vLLM's shape) and both replies carry output
token ids (a follow-up's prompt holds the reference's); else text, with the fillers
rendered by a ``Renderer``. A server that refuses ``logprobs`` is compared by its text.

Each server has its own limit of ``concurrency`` requests in flight; a session's steps run
in order, each sent to both servers at once, so a follow-up reaches the tested server after
its own answer to the turn before (the case where it resumes from its own checkpoint).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from cluster.bench.client import Target
from cluster.bench.correctness_compare import Comparison, Reply, compare, parse_choice
from cluster.bench.correctness_workload import Filler, Piece, Session, Step, Text, Workload
from cluster.bench.workloads import Renderer

PromptFormat = Literal["ids", "text"]
Prompt = list[int] | str
TOP_LOGPROBS = 5


@dataclass(frozen=True)
class Endpoint:
    target: Target
    model: str

    @property
    def root(self) -> str:
        """The server's root (``/tokenize`` lives there, not under ``/v1``)."""
        return self.target.v1[: -len("/v1")]


@dataclass(frozen=True)
class Capabilities:
    prompt_format: PromptFormat
    logprobs: bool
    notes: tuple[str, ...] = ()  # why a weaker form was chosen


@dataclass(frozen=True)
class Sent:
    """One request's answer from one server: a reply, or why there is none."""

    reply: Reply | None
    error: str | None = None
    prompt_tokens: int = 0  # from ``usage``: how much of the prompt a cache served
    cached_tokens: int = 0


@dataclass(frozen=True)
class Outcome:
    session: Session
    turn: int
    reference: Sent
    tested: Sent
    comparison: Comparison | None  # None when either server failed

    @property
    def step(self) -> Step:
        return self.session.steps[self.turn]


async def model_id(client: Any, target: Target) -> str:
    if target.model:
        return target.model
    try:
        r = await client.get(f"{target.v1}/models", headers=target.headers())
        r.raise_for_status()
    except httpx.HTTPError as exc:  # an unreachable or refusing server: a clear error, not a traceback
        raise ValueError(f"{target.v1}/models: {type(exc).__name__}: {exc}") from exc
    data = r.json().get("data") or []
    if not data:
        raise ValueError(f"{target.v1}/models lists no model")
    return str(data[0]["id"])


def request_body(ep: Endpoint, prompt: Prompt, max_tokens: int, logprobs: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": ep.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    if logprobs:
        body.update(logprobs=TOP_LOGPROBS, return_tokens_as_token_ids=True, return_token_ids=True)
    return body


async def complete(client: Any, ep: Endpoint, prompt: Prompt, max_tokens: int, logprobs: bool) -> Sent:
    body = request_body(ep, prompt, max_tokens, logprobs)
    try:
        r = await client.post(f"{ep.target.v1}/completions", json=body, headers=ep.target.headers())
        if r.status_code != 200:
            return Sent(None, f"HTTP {r.status_code}: {r.text[:300]}")
        data = r.json()
        choices = data.get("choices") or []
        if not choices:
            return Sent(None, "no choices in the response")
        usage = data.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return Sent(parse_choice(choices[0]), None, int(usage.get("prompt_tokens") or 0), int(cached))
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, not a crash
        return Sent(None, f"{type(exc).__name__}: {exc}"[:300])


async def tokenize(client: Any, ep: Endpoint, text: str) -> list[int]:
    body = {"model": ep.model, "prompt": text, "add_special_tokens": False}
    r = await client.post(f"{ep.root}/tokenize", json=body, headers=ep.target.headers())
    if r.status_code != 200:
        raise ValueError(f"{ep.root}/tokenize answered HTTP {r.status_code}: {r.text[:200]}")
    tokens = r.json().get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise ValueError(f"{ep.root}/tokenize returned no token ids")
    return tokens


async def detect(
    client: Any, tested: Endpoint, reference: Endpoint, wanted: str, probe_ids: Sequence[int]
) -> Capabilities:
    """The strongest form both servers answer: ids prompts with token ids, else text with
    logprobs, else text alone. ``wanted``: ``auto``, ``ids`` (refuse anything less) or ``text``."""
    notes: list[str] = []
    if wanted in ("auto", "ids"):
        why = await _ids_unsupported(client, tested, reference, probe_ids)
        if why is None:
            return Capabilities("ids", True)
        if wanted == "ids":
            raise ValueError(f"--prompt-format ids: {why}")
        notes.append(f"text prompts: {why}")
    for ep in (tested, reference):
        sent = await complete(client, ep, "Hello", 2, logprobs=True)
        if sent.reply is None or sent.reply.keys is None:
            notes.append(f"text comparison: {ep.target.v1} gave no logprobs ({sent.error or 'none in the reply'})")
            return Capabilities("text", False, tuple(notes))
    return Capabilities("text", True, tuple(notes))


async def _ids_unsupported(client: Any, tested: Endpoint, reference: Endpoint, probe_ids: Sequence[int]) -> str | None:
    try:
        await tokenize(client, tested, "Hello")
    except Exception as exc:  # noqa: BLE001 - the reason is reported
        return f"no /tokenize on the tested server ({exc})"[:300]
    for ep in (tested, reference):
        sent = await complete(client, ep, list(probe_ids), 2, logprobs=True)
        if sent.reply is None:
            return f"{ep.target.v1} refused a token-id prompt ({sent.error})"
        if sent.reply.token_ids is None:
            return f"{ep.target.v1} returned no output token ids"
    return None


class PromptBuilder:
    """Steps -> prompts in the chosen format (``texts``: the workload's ``Text`` pieces,
    tokenized beforehand in ids mode)."""

    def __init__(self, fmt: PromptFormat, renderer: Renderer, texts: dict[str, list[int]] | None = None) -> None:
        self.fmt, self.renderer, self.texts = fmt, renderer, texts or {}

    def piece(self, p: Piece) -> Prompt:
        if isinstance(p, Filler):
            return list(p.ids) if self.fmt == "ids" else self.renderer.text(p.ids)
        return list(self.texts[p.text]) if self.fmt == "ids" else p.text

    def join(self, parts: Sequence[Prompt]) -> Prompt:
        if self.fmt == "ids":
            return [t for part in parts for t in part]  # type: ignore[union-attr]
        return "".join(parts)  # type: ignore[arg-type]

    def prompt(self, system: tuple[int, ...], step: Step, before: Prompt | None, answer: Reply | None) -> Prompt:
        if step.kind == "first":
            return self.join([self.piece(Filler(system)), *(self.piece(p) for p in step.pieces)])
        if before is None or answer is None:
            raise ValueError(f"a {step.kind} step needs the step before it")
        if step.kind == "repeat":
            return before
        out: Prompt = list(answer.token_ids or ()) if self.fmt == "ids" else answer.text
        return self.join([before, out, *(self.piece(p) for p in step.pieces)])


async def tokenize_texts(client: Any, ep: Endpoint, workload: Workload) -> dict[str, list[int]]:
    texts = {p.text for s in workload.sessions for st in s.steps for p in st.pieces if isinstance(p, Text)}
    return {t: await tokenize(client, ep, t) for t in sorted(texts)}


async def run_sessions(
    client: Any,
    tested: Endpoint,
    reference: Endpoint,
    workload: Workload,
    caps: Capabilities,
    builder: PromptBuilder,
    concurrency: int,
    near_tie: float | None = None,
    on_done: Callable[[int], None] | None = None,
) -> list[Outcome]:
    limits = (asyncio.Semaphore(concurrency), asyncio.Semaphore(concurrency))  # reference, tested
    outcomes: list[Outcome] = []

    async def send(which: int, prompt: Prompt, max_tokens: int) -> Sent:
        async with limits[which]:
            return await complete(client, (reference, tested)[which], prompt, max_tokens, caps.logprobs)

    async def session(s: Session) -> None:
        before: Prompt | None = None
        answer: Reply | None = None
        for k, step in enumerate(s.steps):
            prompt = builder.prompt(workload.system_prompts[s.system_index], step, before, answer)
            ref, got = await asyncio.gather(send(0, prompt, step.max_tokens), send(1, prompt, step.max_tokens))
            both = ref.reply is not None and got.reply is not None
            outcomes.append(Outcome(s, k, ref, got, compare(ref.reply, got.reply, near_tie) if both else None))
            if on_done is not None:
                on_done(len(outcomes))
            if ref.reply is None:
                return  # the next step's prompt needs this answer
            before, answer = prompt, ref.reply

    await asyncio.gather(*(session(s) for s in workload.sessions))
    outcomes.sort(key=lambda o: (o.session.session_id, o.turn))
    return outcomes
