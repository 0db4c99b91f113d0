"""``hybridserve bench correctness``: the server under test against a reference, output by output.

    hybridserve bench correctness --url http://127.0.0.1:8000 --reference-url http://127.0.0.1:8001 \
        [--concurrency 8 --requests 200 --seed 0 --page-size 16 --track-interval 256 \
         --near-tie [--near-tie-tolerance 0.1] --prompt-format auto --json --out result.json]

The reference is the same model with prefix caching, speculation and overlap off, on any
OpenAI-compatible server (ours, vLLM, SGLang). The workload (``correctness_workload``) puts
prompt lengths where hybrid caches break; every request runs greedy on both servers and the
outputs are compared token by token (``correctness_compare``). It prints the requests, the
divergent outputs, the malformed JSON outputs and the first divergences; ``--json`` makes
the last line of stdout the result as JSON. Exit status 1 when any output diverges, any
JSON output is malformed where the reference's parses, or any request fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cluster.bench.correctness_compare import is_malformed_json, json_parses
from cluster.bench.correctness_workload import WorkloadSettings, build_workload
from configs.schema import CacheConfig

if TYPE_CHECKING:  # the HTTP client's modules load when a run starts, not with the CLI
    from cluster.bench.client import Target
    from cluster.bench.correctness_client import Capabilities, Outcome
    from cluster.bench.workloads import Renderer

DEFAULT_TOLERANCE = 0.1  # nats: bf16 logits of a near tie differ by about this much


@dataclass(frozen=True)
class Found:
    """One divergent output, for the report."""

    session_id: int
    turn: int
    session_kind: str
    position: int
    unit: str
    expected: str
    got: str


@dataclass(frozen=True)
class CorrectnessResult:
    requests: int
    compared: int
    errors: int
    divergent: int
    near_ties: int
    json_requests: int
    json_reference_parsed: int
    malformed_json: int
    tested_prompt_tokens: int  # as the tested server's ``usage`` counts them
    tested_cached_tokens: int  # of which a cache served (0: the run tested no cache)
    prompt_format: str
    unit: str  # token, char or mixed
    concurrency: int
    duration_s: float
    load_avg_1m: tuple[float, float]  # at the start and at the end
    divergences: tuple[Found, ...]
    first_error: str | None = None
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.divergent == 0 and self.malformed_json == 0 and self.errors == 0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def summarize(
    outcomes: Sequence[Outcome],
    caps: Capabilities,
    concurrency: int,
    duration_s: float,
    load_avg_1m: tuple[float, float] = (0.0, 0.0),
    show: int = 5,
) -> CorrectnessResult:
    found: list[Found] = []
    errors: list[str] = []
    units: set[str] = set()
    compared = near_ties = json_requests = json_parsed = malformed = 0
    prompt_tokens = sum(o.tested.prompt_tokens for o in outcomes)
    cached_tokens = sum(o.tested.cached_tokens for o in outcomes)
    for o in outcomes:
        c, ref, got = o.comparison, o.reference.reply, o.tested.reply
        if c is None or ref is None or got is None:
            errors.append(o.reference.error or o.tested.error or "no reply")
            continue
        compared += 1
        units.add(c.unit)
        near_ties += c.near_tie is not None
        if c.divergence is not None:
            d = c.divergence
            found.append(Found(o.session.session_id, o.turn, o.session.kind, d.position, d.unit, d.expected, d.got))
        prefix = o.step.json_prefix
        if prefix is not None:
            json_requests += 1
            json_parsed += json_parses(prefix, ref.text)
            malformed += is_malformed_json(prefix, ref, got)
    return CorrectnessResult(
        requests=len(outcomes),
        compared=compared,
        errors=len(errors),
        divergent=len(found),
        near_ties=near_ties,
        json_requests=json_requests,
        json_reference_parsed=json_parsed,
        malformed_json=malformed,
        tested_prompt_tokens=prompt_tokens,
        tested_cached_tokens=cached_tokens,
        prompt_format=caps.prompt_format,
        unit=units.pop() if len(units) == 1 else ("mixed" if units else "none"),
        concurrency=concurrency,
        duration_s=round(duration_s, 2),
        load_avg_1m=load_avg_1m,
        divergences=tuple(found[:show]),
        first_error=errors[0] if errors else None,
        notes=caps.notes,
    )


def format_report(r: CorrectnessResult) -> str:
    lines = [
        f"correctness: {r.requests} requests at concurrency {r.concurrency} ({r.prompt_format} prompts, "
        f"compared by {r.unit}) in {r.duration_s:.1f} s, load {r.load_avg_1m[0]:.2f} -> {r.load_avg_1m[1]:.2f}",
        f"  compared         {r.compared}",
        f"  divergent        {r.divergent}",
        f"  near ties        {r.near_ties} (forgiven)",
        f"  malformed JSON   {r.malformed_json} (of {r.json_requests} JSON requests, "
        f"{r.json_reference_parsed} of which the reference's parse)",
        f"  failed requests  {r.errors}" + (f" (first: {r.first_error})" if r.first_error else ""),
        f"  cached prompt    {r.tested_cached_tokens} of {r.tested_prompt_tokens} tokens on the tested server",
    ]
    lines += [f"  note: {n}" for n in r.notes]
    for f in r.divergences:
        lines.append(
            f"  diverged: session {f.session_id} turn {f.turn} ({f.session_kind}) at {f.unit} {f.position}: "
            f"expected {f.expected}, got {f.got}"
        )
    lines.append("OK: every output matches the reference" if r.ok else "FAILED")
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser | Any) -> None:
    """The options (``hybridserve bench correctness`` adds them as a group; ``--url``,
    ``--model``, ``--api-key``, ``--seed``, ``--tokenizer``, ``--json`` and ``--out`` are the
    bench command's own)."""
    cache = CacheConfig()
    p.add_argument("--reference-url", default=None, help="correctness: the reference server's base URL")
    p.add_argument("--reference-model", default=None, help="correctness: its model id (default: its first)")
    p.add_argument("--reference-api-key", default=None)
    p.add_argument("--concurrency", type=int, default=8, help="correctness: requests in flight on each server")
    p.add_argument("--requests", type=int, default=200, help="correctness: requests in all")
    p.add_argument("--max-tokens", type=int, default=24, help="correctness: output tokens (JSON requests: twice)")
    p.add_argument("--page-size", type=int, default=cache.page_size, help="the tested server's cache.page_size")
    p.add_argument(
        "--track-interval",
        type=int,
        default=cache.mamba_track_interval,
        help="the tested server's cache.mamba_track_interval",
    )
    p.add_argument("--system-prompts", type=int, default=8, help="correctness: shared system prompts")
    p.add_argument("--max-system-len", type=int, default=None, help="correctness: longest system prompt (tokens)")
    p.add_argument(
        "--token-range", type=int, nargs=2, default=(16, 500), metavar=("LOW", "HIGH"), help="filler token ids"
    )
    p.add_argument("--prompt-format", choices=("auto", "ids", "text"), default="auto", help="correctness prompts")
    p.add_argument(
        "--near-tie", action="store_true", help="forgive a first divergence that is a near tie in the reference"
    )
    p.add_argument("--near-tie-tolerance", type=float, default=DEFAULT_TOLERANCE, help="nats below the best")
    p.add_argument("--show", type=int, default=5, help="correctness: divergences printed")


def settings_from(args: argparse.Namespace) -> WorkloadSettings:
    settings = WorkloadSettings(
        requests=args.requests,
        seed=0 if args.seed is None else args.seed,
        page_size=args.page_size,
        track_interval=args.track_interval,
        max_tokens=args.max_tokens,
        json_max_tokens=2 * args.max_tokens,
        num_system_prompts=args.system_prompts,
        max_system_len=args.max_system_len,
        token_low=args.token_range[0],
        token_high=args.token_range[1],
    )
    settings.check()
    return settings


def run(args: argparse.Namespace) -> int:
    if not args.url or not args.reference_url:
        raise ValueError("bench correctness needs --url (the server under test) and --reference-url")
    if args.concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {args.concurrency}")
    if args.near_tie and args.near_tie_tolerance < 0:
        raise ValueError(f"--near-tie-tolerance must be >= 0, got {args.near_tie_tolerance}")
    from cluster.bench.client import Target
    from cluster.bench.workloads import Renderer

    tested = Target(args.url, args.model, args.api_key)
    reference = Target(args.reference_url, args.reference_model, args.reference_api_key)
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else print
    result = asyncio.run(
        check(
            tested,
            reference,
            settings_from(args),
            args.concurrency,
            near_tie=args.near_tie_tolerance if args.near_tie else None,
            prompt_format=args.prompt_format,
            renderer=Renderer.from_path(args.tokenizer),
            show=args.show,
            log=log,
        )
    )
    log(format_report(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    if args.json:
        print(json.dumps(result.to_dict()))
    return 0 if result.ok else 1


async def check(
    tested: Target,
    reference: Target,
    settings: WorkloadSettings,
    concurrency: int,
    near_tie: float | None = None,
    prompt_format: str = "auto",
    renderer: Renderer | None = None,
    show: int = 5,
    log: Any = None,
) -> CorrectnessResult:
    """Build the workload, find what both servers support, run it; the summary."""
    import httpx

    from cluster.bench.correctness_client import Endpoint, PromptBuilder, detect, model_id, run_sessions, tokenize_texts
    from cluster.bench.workloads import Renderer

    workload = build_workload(settings)
    limits = httpx.Limits(max_connections=2 * concurrency + 2, max_keepalive_connections=2 * concurrency + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0), limits=limits, trust_env=False) as c:
        t_ep = Endpoint(tested, await model_id(c, tested))
        r_ep = Endpoint(reference, await model_id(c, reference))
        probe = workload.system_prompts[0][:4]
        caps = await detect(c, t_ep, r_ep, prompt_format, probe)
        texts = await tokenize_texts(c, t_ep, workload) if caps.prompt_format == "ids" else {}
        builder = PromptBuilder(caps.prompt_format, renderer or Renderer(), texts)
        every = max(1, workload.num_requests // 10)
        start, load0 = time.perf_counter(), os.getloadavg()[0]

        def progress(n: int) -> None:
            if log is not None and n % every == 0:
                log(f"  {n}/{workload.num_requests} requests, {time.perf_counter() - start:.0f} s")

        outcomes = await run_sessions(c, t_ep, r_ep, workload, caps, builder, concurrency, near_tie, progress)
        duration = time.perf_counter() - start
    return summarize(outcomes, caps, concurrency, duration, (load0, os.getloadavg()[0]), show)
