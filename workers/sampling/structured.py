"""The structured-output constraint of a request (``SamplingParams.structured_output``).

A small frozen value: what kind of constraint and its spec. It is hashable, so compiled
grammars are cached by it, and it is validated when built (``ValueError`` naming the
problem: the spec is handed to xgrammar's grammar builders, which parse JSON schemas,
regexes, EBNF and structural tags without a tokenizer). Compiling against the
tokenizer happens later, off the hot path (``workers.sampling.grammar``).

Kinds (vLLM's ``structured_outputs`` names, OpenAI's ``response_format`` maps onto them):

- ``json_schema``: ``spec`` is the schema as canonical JSON text; ``strict`` forbids
  properties and items the schema does not name (OpenAI's strict mode).
- ``json_object``: any JSON object; ``spec`` is empty.
- ``regex``: ``spec`` is the pattern (matched in full).
- ``choice``: ``choices`` are the allowed outputs, exactly one of them.
- ``grammar``: ``spec`` is an EBNF grammar (xgrammar's GBNF dialect, rule ``root``).
- ``structural_tag``: ``spec`` is xgrammar's structural-tag JSON (tool-call formats).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

StructuredKind = Literal["json_schema", "json_object", "regex", "choice", "grammar", "structural_tag"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredOutput:
    kind: StructuredKind
    spec: str = ""
    choices: tuple[str, ...] = ()
    strict: bool = True  # json_schema only
    any_whitespace: bool = True  # json kinds: any JSON whitespace between tokens

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {list(KINDS)}, got {self.kind!r}")
        object.__setattr__(self, "choices", tuple(self.choices))
        if self.kind == "choice":
            if not self.choices or not all(isinstance(c, str) for c in self.choices):
                raise ValueError(f"a choice constraint needs a non-empty list of strings, got {list(self.choices)!r}")
        elif self.kind != "json_object" and not (isinstance(self.spec, str) and self.spec):
            raise ValueError(f"a {self.kind} constraint needs a non-empty spec string")
        try:
            build_grammar(self)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"invalid {self.kind} constraint: {_first_line(exc)}") from None

    # -- constructors ----------------------------------------------------------------------
    @classmethod
    def json_schema(
        cls, schema: Mapping[str, Any] | str, strict: bool = True, any_whitespace: bool = True
    ) -> StructuredOutput:
        return cls("json_schema", canonical_json(schema), strict=strict, any_whitespace=any_whitespace)

    @classmethod
    def json_object(cls, any_whitespace: bool = True) -> StructuredOutput:
        return cls("json_object", any_whitespace=any_whitespace)

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> StructuredOutput:
        return cls("choice", choices=tuple(choices))

    @classmethod
    def grammar(cls, ebnf: str) -> StructuredOutput:
        return cls("grammar", ebnf)

    @classmethod
    def structural_tag(cls, tag: Mapping[str, Any] | str) -> StructuredOutput:
        """xgrammar's structural tag, or vLLM's older ``structures`` + ``triggers`` form."""
        value = json.loads(tag) if isinstance(tag, str) else dict(tag)
        if isinstance(value, dict) and "structures" in value:
            value = _from_legacy_tag(value)
        return cls("structural_tag", canonical_json(value))

    def describe(self) -> str:
        """Short text for logs and errors (never the whole schema)."""
        body = ", ".join(self.choices) if self.kind == "choice" else self.spec
        return f"{self.kind}({body[:60]}{'...' if len(body) > 60 else ''})"


def canonical_json(value: Mapping[str, Any] | str) -> str:
    """One text per JSON value (sorted keys), so equal schemas share a compiled grammar."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the schema is not valid JSON: {exc}") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"a JSON schema must be a JSON object, got {type(value).__name__}")
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _from_legacy_tag(tag: dict[str, Any]) -> dict[str, Any]:
    """``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`` in xgrammar's form."""
    import xgrammar as xgr

    try:
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=s["schema"], end=s["end"]) for s in tag["structures"]]
        new = xgr.StructuralTag.from_legacy_structural_tag(items, list(tag.get("triggers", [])))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"invalid structural_tag constraint: {exc}") from None
    return json.loads(new.model_dump_json(by_alias=True))


def choice_ebnf(choices: Sequence[str]) -> str:
    """``root ::= "a" | "b"``: JSON string escapes are valid EBNF literal escapes."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def build_grammar(so: StructuredOutput) -> Any:
    """The xgrammar ``Grammar`` of a constraint (no tokenizer needed; raises on bad specs)."""
    import xgrammar as xgr

    if so.kind == "json_schema":
        return xgr.Grammar.from_json_schema(so.spec, strict_mode=so.strict, any_whitespace=so.any_whitespace)
    if so.kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}', strict_mode=False, any_whitespace=so.any_whitespace)
    if so.kind == "regex":
        return xgr.Grammar.from_regex(so.spec)
    if so.kind == "choice":
        return xgr.Grammar.from_ebnf(choice_ebnf(so.choices))
    if so.kind == "grammar":
        return xgr.Grammar.from_ebnf(so.spec)
    return xgr.Grammar.from_structural_tag(so.spec)


def _first_line(exc: BaseException) -> str:
    """xgrammar's C++ errors start with a time and a source location: keep the message."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    if ": " in text and ".cc:" in text.split(": ", 1)[0]:
        text = text.split(": ", 1)[1]
    return text
