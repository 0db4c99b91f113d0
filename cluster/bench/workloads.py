"""Benchmark workloads, generated deterministically from YAML files in ``configs/workloads/``.

A workload is a list of ``Session``s. A session is one conversation: an optional shared
part (a system prompt, a tenant's context, a group's prefix) and one or more turns, each a
new user message and an output length. Single-turn workloads are sessions of one turn;
multi-turn chats build turn k+1 from turn k's prompt, its output and the next message, so
the client runs a session's turns in order. Token ids are drawn from ``[token_low,
token_high)``, which avoids the special tokens of our tokenizers; the client sends them as
ids or renders them to text (``render``).

Kinds (parameters as in the field names of each spec):
- ``random``: vLLM's random dataset (lengths uniform in ``len * (1 ± range_ratio)``, an
  optional shared random prefix).
- ``shared_prefix``: SGLang's generated-shared-prefix (``num_groups`` system prompts of
  ``system_len`` tokens, ``prompts_per_group`` questions each).
- ``prefix_repetition``: vLLM's prefix repetition (``num_prefixes`` prefixes, unique
  suffixes, ``num_prompts`` in all).
- ``cache_pressure``: llm-d's multi-tenant shape. ``num_tenants`` contexts of
  ``context_len`` tokens; when ``num_tenants`` is null it is derived so the contexts fill
  ``cache_fraction`` of ``cluster_cache_tokens`` (the caller knows the cluster). Each
  tenant gets ``queries_per_tenant`` short queries; ``warmup_per_tenant`` more are sent
  first and not measured.
- ``multi_turn``: ``num_sessions`` chats of ``num_turns`` turns; turn 1 is a system
  prompt plus a first message, every later turn appends the previous answer and a
  ``user_len``-token message.
- ``slot_pressure``: agentic sessions (the tiers' workload). ``num_sessions`` agents share
  ``num_toolsets`` system prompts (tool definitions, ``system_len`` tokens); turn 1 is the
  system prompt plus a ``task_len`` task, every later turn appends the previous answer, a
  tool output of ``tool_output_len`` tokens (± ``tool_output_range``) and a short
  ``instruction_len`` instruction, so contexts grow by a few hundred tokens a turn. Sized
  to have more live sessions than the cluster holds device checkpoints (the caller sizes
  the replicas, e.g. ``bench/tiers.py`` with a Qwen3-Next slot-to-KV ratio).

Same spec and seed -> the same sessions, byte for byte; ``seed`` in the YAML can be
overridden (the CLI's ``--seed``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

WORKLOAD_DIR = Path(__file__).resolve().parents[2] / "configs" / "workloads"


# -- what the client runs -----------------------------------------------------------------
@dataclass(frozen=True)
class Turn:
    user_ids: tuple[int, ...]  # the turn's new user content
    max_tokens: int


@dataclass(frozen=True)
class Session:
    session_id: int
    group: str  # tenant / prefix group / conversation label
    shared_ids: tuple[int, ...]  # sent before the first turn (system prompt, context)
    turns: tuple[Turn, ...]

    def first_prompt_ids(self) -> list[int]:
        return list(self.shared_ids) + list(self.turns[0].user_ids)


@dataclass(frozen=True)
class Workload:
    name: str
    kind: str
    api: str  # "completions" | "chat"
    prompt_format: str  # "ids" | "text" (completions only; chat is text)
    sessions: list[Session]
    warmup: list[Session] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)  # derived sizes, for reports

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


# -- specs (one per kind; YAML keys are these field names) ------------------------------------
class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = 0
    api: Literal["completions", "chat"] = "completions"
    prompt_format: Literal["ids", "text"] = "ids"
    token_low: int = Field(16, ge=0)
    token_high: int = Field(500, ge=1)

    @model_validator(mode="after")
    def _check(self) -> _Spec:
        if self.token_high <= self.token_low:
            raise ValueError(f"token_high ({self.token_high}) must exceed token_low ({self.token_low})")
        if self.api == "chat" and self.prompt_format != "text":
            raise ValueError("api 'chat' sends text: set prompt_format: text")
        return self


class RandomSpec(_Spec):
    kind: Literal["random"] = "random"
    num_prompts: int = Field(200, ge=1)
    input_len: int = Field(256, ge=1)
    output_len: int = Field(32, ge=1)
    range_ratio: float = Field(0.25, ge=0.0, lt=1.0)
    prefix_len: int = Field(0, ge=0)  # one random prefix shared by every prompt


class SharedPrefixSpec(_Spec):
    kind: Literal["shared_prefix"] = "shared_prefix"
    num_groups: int = Field(8, ge=1)
    prompts_per_group: int = Field(8, ge=1)
    system_len: int = Field(256, ge=1)
    question_len: int = Field(32, ge=1)
    output_len: int = Field(32, ge=1)
    order: Literal["shuffled", "interleaved", "grouped"] = "shuffled"


class PrefixRepetitionSpec(_Spec):
    kind: Literal["prefix_repetition"] = "prefix_repetition"
    num_prompts: int = Field(100, ge=1)
    num_prefixes: int = Field(10, ge=1)
    prefix_len: int = Field(256, ge=1)
    suffix_len: int = Field(64, ge=1)
    output_len: int = Field(32, ge=1)


class CachePressureSpec(_Spec):
    kind: Literal["cache_pressure"] = "cache_pressure"
    num_tenants: int | None = Field(None, ge=1)
    cluster_cache_tokens: int | None = Field(None, ge=1)
    cache_fraction: float = Field(0.7, gt=0.0)
    context_len: int = Field(384, ge=1)
    query_len: int = Field(32, ge=1)
    query_len_range: float = Field(0.25, ge=0.0, lt=1.0)
    queries_per_tenant: int = Field(8, ge=1)
    warmup_per_tenant: int = Field(1, ge=0)
    output_len: int = Field(16, ge=1)

    def tenants(self) -> int:
        if self.num_tenants is not None:
            return self.num_tenants
        if self.cluster_cache_tokens is None:
            raise ValueError(
                "cache_pressure needs num_tenants or cluster_cache_tokens "
                "(the cluster's cache size in tokens) to size the tenants"
            )
        return max(1, round(self.cache_fraction * self.cluster_cache_tokens / self.context_len))


class MultiTurnSpec(_Spec):
    kind: Literal["multi_turn"] = "multi_turn"
    num_sessions: int = Field(16, ge=1)
    num_turns: int = Field(4, ge=1)
    system_len: int = Field(64, ge=0)
    first_len: int = Field(96, ge=1)
    user_len: int = Field(32, ge=1)
    output_len: int = Field(32, ge=1)


class SlotPressureSpec(_Spec):
    kind: Literal["slot_pressure"] = "slot_pressure"
    num_sessions: int = Field(32, ge=1)
    num_turns: int = Field(4, ge=1)
    num_toolsets: int = Field(4, ge=1)
    system_len: int = Field(192, ge=0)
    task_len: int = Field(48, ge=1)
    tool_output_len: int = Field(96, ge=1)
    tool_output_range: float = Field(0.5, ge=0.0, lt=1.0)
    instruction_len: int = Field(12, ge=1)
    output_len: int = Field(24, ge=1)


WorkloadSpec = Annotated[
    Union[RandomSpec, SharedPrefixSpec, PrefixRepetitionSpec, CachePressureSpec, MultiTurnSpec, SlotPressureSpec],
    Field(discriminator="kind"),
]
_ADAPTER: TypeAdapter[Any] = TypeAdapter(WorkloadSpec)


def workload_names() -> list[str]:
    """The workloads shipped in ``configs/workloads`` (``suite.yaml`` is the suite's config)."""
    return sorted(f.stem for f in WORKLOAD_DIR.glob("*.yaml") if f.stem != "suite")


def workload_path(name_or_path: str | Path) -> Path:
    """A YAML path, or the name of a file in ``configs/workloads`` (without ``.yaml``)."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return p
    named = WORKLOAD_DIR / f"{name_or_path}.yaml"
    if named.exists():
        return named
    known = workload_names()
    raise ValueError(f"no workload {str(name_or_path)!r}: not a YAML file, nor one of {known}")


def load_spec(name_or_path: str | Path, overrides: Mapping[str, Any] | None = None) -> Any:
    """Read a workload YAML and apply overrides; ValueError names bad or unknown keys."""
    path = workload_path(name_or_path)
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"workload file {path} must hold a mapping")
    data.update(overrides or {})
    try:
        return _ADAPTER.validate_python(data)
    except ValidationError as exc:
        errs = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"invalid workload {path.name}: {errs}") from None


def load_workload(name_or_path: str | Path, overrides: Mapping[str, Any] | None = None) -> Workload:
    spec = load_spec(name_or_path, overrides)
    return build(spec, Path(workload_path(name_or_path)).stem)


# -- generators ----------------------------------------------------------------------------
class _Ids:
    def __init__(self, spec: _Spec) -> None:
        self.rng = random.Random(spec.seed)
        self.low, self.high = spec.token_low, spec.token_high

    def draw(self, n: int) -> tuple[int, ...]:
        return tuple(self.rng.randrange(self.low, self.high) for _ in range(n))

    def length(self, mean: int, ratio: float) -> int:
        return max(1, self.rng.randint(int(mean * (1 - ratio)), int(mean * (1 + ratio))))


def _random(spec: RandomSpec) -> tuple[list[Session], list[Session], dict[str, Any]]:
    ids = _Ids(spec)
    prefix = ids.draw(spec.prefix_len)
    sessions = [
        Session(
            i,
            "random",
            prefix,
            (
                Turn(
                    ids.draw(ids.length(spec.input_len, spec.range_ratio)),
                    ids.length(spec.output_len, spec.range_ratio),
                ),
            ),
        )
        for i in range(spec.num_prompts)
    ]
    return sessions, [], {}


def _shared_prefix(spec: SharedPrefixSpec) -> tuple[list[Session], list[Session], dict[str, Any]]:
    ids = _Ids(spec)
    systems = [ids.draw(spec.system_len) for _ in range(spec.num_groups)]
    pairs = [(g, q) for g in range(spec.num_groups) for q in range(spec.prompts_per_group)]
    questions = {pair: ids.draw(spec.question_len) for pair in pairs}
    if spec.order == "interleaved":
        pairs.sort(key=lambda p: (p[1], p[0]))
    elif spec.order == "shuffled":
        ids.rng.shuffle(pairs)
    sessions = [
        Session(i, f"group-{g}", systems[g], (Turn(questions[(g, q)], spec.output_len),))
        for i, (g, q) in enumerate(pairs)
    ]
    return sessions, [], {}


def _prefix_repetition(spec: PrefixRepetitionSpec) -> tuple[list[Session], list[Session], dict[str, Any]]:
    ids = _Ids(spec)
    prefixes = [ids.draw(spec.prefix_len) for _ in range(spec.num_prefixes)]
    items = [(i % spec.num_prefixes, ids.draw(spec.suffix_len)) for i in range(spec.num_prompts)]
    ids.rng.shuffle(items)
    sessions = [
        Session(i, f"prefix-{p}", prefixes[p], (Turn(suffix, spec.output_len),)) for i, (p, suffix) in enumerate(items)
    ]
    return sessions, [], {}


def _cache_pressure(spec: CachePressureSpec) -> tuple[list[Session], list[Session], dict[str, Any]]:
    ids = _Ids(spec)
    num_tenants = spec.tenants()
    contexts = [ids.draw(spec.context_len) for _ in range(num_tenants)]

    def queries(n: int) -> list[int]:
        order = [t for t in range(num_tenants) for _ in range(n)]
        ids.rng.shuffle(order)
        return order

    def session(i: int, t: int) -> Session:
        q = ids.draw(ids.length(spec.query_len, spec.query_len_range))
        return Session(i, f"tenant-{t}", contexts[t], (Turn(q, spec.output_len),))

    warm = queries(spec.warmup_per_tenant)
    warmup = [session(i, t) for i, t in enumerate(warm)]
    sessions = [session(len(warm) + i, t) for i, t in enumerate(queries(spec.queries_per_tenant))]
    info = {"num_tenants": num_tenants, "context_tokens": num_tenants * spec.context_len}
    if spec.cluster_cache_tokens:
        info["context_fraction_of_cluster_cache"] = round(num_tenants * spec.context_len / spec.cluster_cache_tokens, 3)
    return sessions, warmup, info


def _multi_turn(spec: MultiTurnSpec) -> tuple[list[Session], list[Session], dict[str, Any]]:
    ids = _Ids(spec)
    sessions = []
    for i in range(spec.num_sessions):
        system = ids.draw(spec.system_len)
        turns = [Turn(ids.draw(spec.first_len), spec.output_len)]
        turns += [Turn(ids.draw(spec.user_len), spec.output_len) for _ in range(spec.num_turns - 1)]
        sessions.append(Session(i, f"chat-{i}", system, tuple(turns)))
    return sessions, [], {}


def _slot_pressure(spec: SlotPressureSpec) -> tuple[list[Session], list[Session], dict[str, Any]]:
    ids = _Ids(spec)
    toolsets = [ids.draw(spec.system_len) for _ in range(spec.num_toolsets)]
    sessions = []
    for i in range(spec.num_sessions):
        turns = [Turn(ids.draw(spec.task_len), spec.output_len)]
        for _ in range(spec.num_turns - 1):
            tool = ids.draw(ids.length(spec.tool_output_len, spec.tool_output_range))
            turns.append(Turn(tool + ids.draw(spec.instruction_len), spec.output_len))
        sessions.append(Session(i, f"toolset-{i % spec.num_toolsets}", toolsets[i % spec.num_toolsets], tuple(turns)))
    final = [len(s.shared_ids) + sum(len(t.user_ids) + t.max_tokens for t in s.turns) for s in sessions]
    return sessions, [], {"mean_final_context": round(sum(final) / len(final), 1)}


_GENERATORS: dict[str, Callable[[Any], tuple[list[Session], list[Session], dict[str, Any]]]] = {
    "random": _random,
    "shared_prefix": _shared_prefix,
    "prefix_repetition": _prefix_repetition,
    "cache_pressure": _cache_pressure,
    "multi_turn": _multi_turn,
    "slot_pressure": _slot_pressure,
}


def build(spec: Any, name: str | None = None) -> Workload:
    sessions, warmup, info = _GENERATORS[spec.kind](spec)
    return Workload(name or spec.kind, spec.kind, spec.api, spec.prompt_format, sessions, warmup, info)


# -- rendering ids as text -----------------------------------------------------------------
_WORDS = (
    "the quick brown fox jumps over lazy dog small model still say hello world once upon "
    "time there was little server that answered every request with care speed read prompt "
    "thought while then wrote answer one token at system user asks question assistant "
    "replies memory state cache prefix layer batch response stream red orange yellow green "
    "blue indigo violet morning coffee tea noon bread soup night sleep monday friday"
).split()


class Renderer:
    """Token ids -> text: the model's tokenizer when given, else a fixed word list.

    Word rendering is deterministic and tokenizer-free (for servers whose tokenizer we do
    not have); lengths are then in words. Either way the lengths are approximate (text
    concatenation can merge tokens at the seams); the server's ``usage`` has the truth.
    """

    def __init__(self, tokenizer: Any = None) -> None:
        self._tokenizer = tokenizer

    @classmethod
    def from_path(cls, path: str | Path | None) -> Renderer:
        if path is None:
            return cls()
        from workers.loader import load_tokenizer

        return cls(load_tokenizer(path))

    def text(self, ids: Sequence[int]) -> str:
        """Text of about ``len(ids)`` tokens. With a tokenizer, random ids decode to text
        that re-encodes into more tokens, so (as vLLM's random dataset does) the text is
        re-encoded, cut to ``len(ids)`` tokens and decoded again."""
        if not ids:
            return ""
        if self._tokenizer is not None:
            tok = self._tokenizer
            text = str(tok.decode(list(ids), skip_special_tokens=True))
            again = tok.encode(text, add_special_tokens=False)
            if len(again) > len(ids):
                text = str(tok.decode(again[: len(ids)], skip_special_tokens=True))
            return text
        return " ".join(_WORDS[i % len(_WORDS)] for i in ids) + " "
