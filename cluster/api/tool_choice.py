"""``tool_choice: required`` and a named function, enforced by a JSON-schema constraint.

As vLLM does it, the constrained output is JSON, not the model's own tool-call format:

- a named function: the output IS its arguments object (the function's ``parameters``
  schema; an empty object when it has none);
- ``required``: the output is a JSON array of ``{"name": ..., "parameters": {...}}``, at
  least one (exactly one without ``parallel_tool_calls``), each item one of the tools.

``forced_schema`` builds the schema (the tools' ``$defs`` hoisted to the top; two tools
defining one name differently are a 400). ``ForcedToolParser`` reads the constrained
output into the same ``ParsedDelta``s as the format parsers: a named call streams its
arguments as they are generated; ``required`` emits each call once its array item is
complete.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from cluster.api.errors import OpenAIError
from cluster.api.tool_parsers import ParsedDelta, ToolCallDelta, new_call_id

EMPTY_OBJECT = {"type": "object", "properties": {}}


def _parameters(tool: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """The tool's parameters schema with its ``$defs`` moved into ``defs``."""
    params = dict(tool["function"].get("parameters") or EMPTY_OBJECT)
    for name, schema in params.pop("$defs", {}).items():
        if defs.setdefault(name, schema) != schema:
            raise OpenAIError(
                f"tools define $defs {name!r} differently; tool_choice required needs one definition per name",
                param="tools",
            )
    return params


def forced_schema(tools: Sequence[dict[str, Any]], named: str | None, parallel: bool) -> dict[str, Any]:
    """The JSON schema the output must follow (``named``: that function's; else required)."""
    defs: dict[str, Any] = {}
    if named is not None:
        tool = next(t for t in tools if t["function"]["name"] == named)
        schema = _parameters(tool, defs)
    else:
        items = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t["function"]["name"]]},
                    "parameters": _parameters(t, defs),
                },
                "required": ["name", "parameters"],
            }
            for t in tools
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not parallel:
            schema["maxItems"] = 1
    return {**schema, "$defs": defs} if defs else schema


class ForcedToolParser:
    """The constrained output as tool-call deltas (feed text, then ``finish``)."""

    def __init__(self, named: str | None) -> None:
        self.named = named
        self.num_calls = 0
        self._buf = ""
        self._pos = 0  # required: where the next array item may start

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if self.named is not None:
            if self.num_calls == 0:
                out.tool_calls.append(ToolCallDelta(0, new_call_id(), self.named, ""))
                self.num_calls = 1
            if text:
                out.tool_calls.append(ToolCallDelta(0, None, None, text))
            return out
        self._buf += text
        decoder = json.JSONDecoder()
        while True:
            start = self._skip(self._pos)
            if start >= len(self._buf):
                return out
            try:
                item, end = decoder.raw_decode(self._buf, start)
            except json.JSONDecodeError:
                return out  # an item still being written
            self._pos = end
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                args = json.dumps(item.get("parameters", {}), ensure_ascii=False)
                out.tool_calls += [
                    ToolCallDelta(self.num_calls, new_call_id(), item["name"], ""),
                    ToolCallDelta(self.num_calls, None, None, args),
                ]
                self.num_calls += 1

    def _skip(self, pos: int) -> int:
        """Past whitespace and the array's ``[`` / ``,`` / ``]``."""
        while pos < len(self._buf) and self._buf[pos] in " \t\r\n[,]":
            pos += 1
        return pos

    def finish(self) -> ParsedDelta:
        return self.feed("") if self.named is None else ParsedDelta()
