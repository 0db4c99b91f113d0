"""Comparing one output of the server under test with the reference's.

Token by token where both replies carry tokens of the same kind (``id``: the
``token_id:N`` strings of ``return_tokens_as_token_ids``; ``str``: token strings), else
character by character over the text. Exact by default (fp32: greedy outputs must be
identical). With a near-tie tolerance (bf16), the first mismatch at position i is forgiven
when the tested token is among the reference's top 5 at i with a logprob at most
``tolerance`` below the best one; the outputs have then gone separate ways, so the rest
is not compared.

JSON: a tool-call request's output continues an opened JSON object; it parses when that
object, cut at ``</tool_call>``, decodes (trailing text allowed). A malformed output is
one that does not parse where the reference's does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

TokenKind = Literal["id", "str"]
TOP_N = 5
ID_PREFIX = "token_id:"


@dataclass(frozen=True)
class Reply:
    """One completion as the comparison sees it (``parse_choice`` builds it)."""

    text: str
    keys: tuple[str, ...] | None = None  # one per output token; None: no logprobs
    kind: TokenKind | None = None
    tops: tuple[dict[str, float], ...] | None = None  # per position, keyed like ``keys``
    offsets: tuple[int, ...] | None = None  # each token's start in ``text``
    token_ids: tuple[int, ...] | None = None
    finish_reason: str | None = None


@dataclass(frozen=True)
class Divergence:
    position: int
    unit: Literal["token", "char"]
    expected: str
    got: str


@dataclass(frozen=True)
class Comparison:
    divergence: Divergence | None  # the first mismatch not forgiven
    near_tie: Divergence | None  # a forgiven mismatch (nothing after it was compared)
    unit: Literal["token", "char"]


def parse_choice(choice: dict[str, Any]) -> Reply:
    """A ``/v1/completions`` choice -> ``Reply``; ValueError when its logprobs are malformed."""
    text = choice.get("text")
    if not isinstance(text, str):
        raise ValueError(f"choice has no text: {str(choice)[:200]}")
    field_ids = choice.get("token_ids")
    ids = tuple(int(t) for t in field_ids) if isinstance(field_ids, list) else None
    lp = choice.get("logprobs")
    if not lp or not lp.get("tokens"):
        return Reply(text, token_ids=ids, finish_reason=choice.get("finish_reason"))
    tokens = [str(t) for t in lp["tokens"]]
    as_ids = all(t.startswith(ID_PREFIX) for t in tokens)
    keys = tuple(_key(t) for t in tokens) if as_ids else tuple(tokens)
    raw_tops = lp.get("top_logprobs")
    tops = None
    if isinstance(raw_tops, list) and len(raw_tops) == len(tokens):
        tops = tuple({_key(k) if as_ids else k: float(v) for k, v in (t or {}).items()} for t in raw_tops)
    offsets = lp.get("text_offset")
    return Reply(
        text,
        keys,
        "id" if as_ids else "str",
        tops,
        tuple(int(o) for o in offsets) if isinstance(offsets, list) and len(offsets) == len(tokens) else None,
        tuple(int(k) for k in keys) if as_ids else ids,
        choice.get("finish_reason"),
    )


def _key(token: str) -> str:
    return token[len(ID_PREFIX) :] if token.startswith(ID_PREFIX) else token


def compare(expected: Reply, got: Reply, near_tie: float | None = None) -> Comparison:
    """``got`` (the server under test) against ``expected`` (the reference)."""
    if expected.keys is None or got.keys is None or expected.kind != got.kind:
        return Comparison(_compare_text(expected.text, got.text), None, "char")
    n = min(len(expected.keys), len(got.keys))
    for i in range(n):
        want, have = expected.keys[i], got.keys[i]
        if want == have:
            continue
        found = Divergence(i, "token", _show(expected, i), _show(got, i))
        if near_tie is not None and is_near_tie(expected, i, have, near_tie):
            return Comparison(None, found, "token")
        return Comparison(found, None, "token")
    if len(expected.keys) != len(got.keys):
        return Comparison(Divergence(n, "token", _show(expected, n), _show(got, n)), None, "token")
    return Comparison(None, None, "token")


def is_near_tie(expected: Reply, position: int, token: str, tolerance: float) -> bool:
    """``token`` is in the reference's top 5 at ``position``, within ``tolerance`` of its best."""
    if expected.tops is None or position >= len(expected.tops):
        return False
    top = sorted(expected.tops[position].items(), key=lambda kv: -kv[1])[:TOP_N]
    if not top:
        return False
    best = top[0][1]
    return any(key == token and best - value <= tolerance for key, value in top)


def _compare_text(expected: str, got: str) -> Divergence | None:
    n = min(len(expected), len(got))
    i = next((k for k in range(n) if expected[k] != got[k]), n)
    if i == n and len(expected) == len(got):
        return None
    return Divergence(i, "char", _tail(expected, i), _tail(got, i))


def _tail(text: str, i: int) -> str:
    return repr(text[i : i + 16]) if i < len(text) else "<end>"


def _show(reply: Reply, i: int) -> str:
    """Token ``i`` for a report: the key, and for ids the text from its offset."""
    if reply.keys is None or i >= len(reply.keys):
        return f"<end: {reply.finish_reason}>"
    if reply.kind == "str":
        return repr(reply.keys[i])
    piece = ""
    if reply.offsets is not None:
        end = reply.offsets[i + 1] if i + 1 < len(reply.offsets) else len(reply.text)
        piece = f" {reply.text[reply.offsets[i] : end]!r}"
    return f"{reply.keys[i]}{piece}"


def json_parses(prefix: str, output: str) -> bool:
    """Whether ``prefix + output``, cut at ``</tool_call>``, starts with a JSON object."""
    text = (prefix + output).split("</tool_call>", 1)[0].strip()
    try:
        value, _ = json.JSONDecoder().raw_decode(text)
    except json.JSONDecodeError:
        return False
    return isinstance(value, dict)


def is_malformed_json(prefix: str, expected: Reply, got: Reply) -> bool:
    return json_parses(prefix, expected.text) and not json_parses(prefix, got.text)
