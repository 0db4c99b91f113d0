"""The workload of ``hybridserve bench correctness``: prompts that stress hybrid caches.

A hybrid model's prefix cache is only as right as the recurrent checkpoints it resumes from,
and those are written at page-aligned positions, on the ``mamba_track_interval`` grid and at
the end of an output. So the workload puts lengths exactly there:

- ``num_system_prompts`` shared system prompts whose lengths are page-size and grid
  boundaries ± 1 (``boundary_lengths``); half of the first turns also end their whole
  prompt on such a boundary;
- sessions of four kinds: ``single`` (one prompt), ``repeat`` (the same prompt again, once
  the first has finished: a full cache hit), ``chat`` (follow-ups whose prompt is the turn
  before's prompt + its output + new text: a resume from the end-of-output checkpoint) and
  ``json`` (a tool-call-shaped JSON output asked for by the prompt, then a follow-up asking
  for another).

Prompts are ``Piece``s: ``Filler`` token ids drawn from ``[token_low, token_high)`` (sent as
ids, or rendered to text for servers without token-id prompts) and ``Text`` (tokenized by
the server under test). A follow-up's prompt holds the reference server's output, known
only at run time (``Step.kind``). Same settings and seed -> the same workload.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

SESSION_KINDS = ("single", "repeat", "chat", "json")
TOOLS = ("get_weather", "search_docs", "read_file", "run_query", "send_email", "create_event", "list_users")


@dataclass(frozen=True)
class Filler:
    ids: tuple[int, ...]


@dataclass(frozen=True)
class Text:
    text: str


Piece = Filler | Text
StepKind = Literal["first", "repeat", "follow_up"]


@dataclass(frozen=True)
class Step:
    """One request. ``first``: the prompt is ``pieces``; ``repeat``: the step before's
    prompt again; ``follow_up``: the step before's prompt + the reference's output to it +
    ``pieces``. ``json_prefix``: the start of the JSON object the prompt ends with (the
    output continues it), None when no JSON is asked for."""

    kind: StepKind
    pieces: tuple[Piece, ...]
    max_tokens: int
    json_prefix: str | None = None


@dataclass(frozen=True)
class Session:
    session_id: int
    kind: str  # one of SESSION_KINDS
    system_index: int  # which shared system prompt it starts with
    steps: tuple[Step, ...]


@dataclass(frozen=True)
class WorkloadSettings:
    requests: int
    seed: int = 0
    page_size: int = 16
    track_interval: int = 256
    max_tokens: int = 24
    json_max_tokens: int = 48
    num_system_prompts: int = 8
    max_system_len: int | None = None  # None: every boundary up to 2 grid intervals
    token_low: int = 16
    token_high: int = 500

    def check(self) -> None:
        for name in ("requests", "page_size", "track_interval", "max_tokens", "json_max_tokens", "num_system_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.token_low < self.token_high:
            raise ValueError(f"need 0 <= token_low < token_high, got [{self.token_low}, {self.token_high})")
        if self.max_system_len is not None and self.max_system_len < 1:
            raise ValueError(f"max_system_len must be >= 1, got {self.max_system_len}")


@dataclass(frozen=True)
class Workload:
    settings: WorkloadSettings
    system_prompts: tuple[tuple[int, ...], ...]
    sessions: tuple[Session, ...]

    @property
    def num_requests(self) -> int:
        return sum(len(s.steps) for s in self.sessions)


def boundary_points(page_size: int, track_interval: int) -> list[int]:
    """Where checkpoints and page ends fall: one and two pages, one grid interval, one
    interval plus a page, two intervals."""
    return sorted({page_size, 2 * page_size, track_interval, track_interval + page_size, 2 * track_interval})


def boundary_lengths(page_size: int, track_interval: int, max_len: int | None = None) -> list[int]:
    """Every boundary point ± 1 (and the point itself), at least 1 and at most ``max_len``."""
    out = {p + d for p in boundary_points(page_size, track_interval) for d in (-1, 0, 1)}
    return sorted(n for n in out if n >= 1 and (max_len is None or n <= max_len))


def build_workload(settings: WorkloadSettings) -> Workload:
    settings.check()
    rng = random.Random(settings.seed)
    lengths = boundary_lengths(settings.page_size, settings.track_interval, settings.max_system_len)
    if not lengths:
        raise ValueError(f"max_system_len={settings.max_system_len} leaves no boundary length")
    # Spread the system prompts over the boundaries, short and long.
    n = settings.num_system_prompts
    picks = [lengths[round(i * (len(lengths) - 1) / max(1, n - 1))] for i in range(n)]
    rng.shuffle(picks)
    systems = tuple(_filler(rng, length, settings) for length in picks)
    all_lengths = boundary_lengths(settings.page_size, settings.track_interval)
    sessions: list[Session] = []
    left = settings.requests
    while left > 0:
        kind = rng.choice(SESSION_KINDS)
        system_index = rng.randrange(len(systems))
        steps = _session_steps(rng, kind, len(systems[system_index]), all_lengths, settings)[:left]
        sessions.append(Session(len(sessions), kind, system_index, steps))
        left -= len(steps)
    return Workload(settings, systems, tuple(sessions))


def _filler(rng: random.Random, n: int, s: WorkloadSettings) -> tuple[int, ...]:
    return tuple(rng.randrange(s.token_low, s.token_high) for _ in range(n))


def first_suffix_len(rng: random.Random, system_len: int, lengths: Sequence[int], page_size: int) -> int:
    """A first turn's own length: half the time the one that ends the whole prompt on a
    boundary length (the nearest few above the system prompt), else 1 to two pages + 1."""
    above = [n - system_len for n in lengths if 1 <= n - system_len <= 4 * page_size + 1]
    if above and rng.random() < 0.5:
        return rng.choice(above[:6])
    return rng.randint(1, 2 * page_size + 1)


def _session_steps(
    rng: random.Random, kind: str, system_len: int, lengths: Sequence[int], s: WorkloadSettings
) -> tuple[Step, ...]:
    """The steps of one session; the first step's pieces omit the system prompt (the client
    puts ``Workload.system_prompts[session.system_index]`` first)."""
    suffix = Filler(_filler(rng, first_suffix_len(rng, system_len, lengths, s.page_size), s))
    if kind == "single":
        return (Step("first", (suffix,), s.max_tokens),)
    if kind == "repeat":
        return (Step("first", (suffix,), s.max_tokens), Step("repeat", (), s.max_tokens))
    if kind == "chat":
        turns = [Step("first", (suffix,), s.max_tokens)]
        for _ in range(rng.randint(1, 2)):
            turns.append(Step("follow_up", (_follow_up_text(rng, s),), s.max_tokens))
        return tuple(turns)
    if kind == "json":
        first_tool, second_tool = rng.sample(TOOLS, 2)
        ask1, prefix1 = json_request(first_tool, first=True)
        ask2, prefix2 = json_request(second_tool, first=False)
        return (
            Step("first", (suffix, Text(ask1)), s.json_max_tokens, prefix1),
            Step("follow_up", (Text(ask2),), s.json_max_tokens, prefix2),
        )
    raise ValueError(f"unknown session kind {kind!r}; expected one of {SESSION_KINDS}")


def _follow_up_text(rng: random.Random, s: WorkloadSettings) -> Piece:
    return Filler(_filler(rng, rng.randint(1, s.page_size + 1), s))


def json_request(tool: str, first: bool) -> tuple[str, str]:
    """(the instruction ending in an opened tool call, that opened JSON object's text)."""
    prefix = f'{{"name": "{tool}", "arguments": {{'
    lead = "Call one tool" if first else "Now call another tool"
    ask = f"\n{lead}: {tool}. Reply with one JSON object and nothing else.\n<tool_call>\n{prefix}"
    return ask, prefix
