"""Tool calls out of generated text, incrementally: Qwen3's two ``<tool_call>`` formats.

- ``hermes`` (Qwen3, Hermes, many fine-tunes)::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

- ``qwen3_xml`` (Qwen3-Coder, Qwen3.5)::

      <tool_call>
      <function=get_weather>
      <parameter=city>
      Paris
      </parameter>
      </function>
      </tool_call>

  Parameter values are text; each is converted by the type its tool's JSON schema gives it
  (``integer``, ``number``, ``boolean``, ``object``, ``array``, ``null``; anything else,
  or a value that does not parse as its type, stays a string).

A parser is fed text deltas and returns ``ParsedDelta``s: content outside tool calls, and
``ToolCallDelta``s shaped as OpenAI streams them (a call's first delta carries its index,
id and name with empty arguments; later ones carry argument fragments). The arguments
fragments of a call concatenate to its arguments JSON text. Feeding a text in one piece
and feeding it in any split give the same content and calls (the non-streaming response
is the streaming parser fed once), except that a malformed call is returned as content
when it is seen whole but cannot be taken back once its first delta was streamed.
Whitespace between or after tool calls is dropped.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PARSERS = ("hermes", "qwen3_xml")


@dataclass(frozen=True)
class ToolCallDelta:
    index: int  # the call's position in the message's tool_calls
    id: str | None  # set on the call's first delta only
    name: str | None  # ditto
    arguments: str  # a fragment of the arguments JSON text


@dataclass
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag`` (to hold back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallParser:
    """The ``<tool_call>`` framing; subclasses read a call's body (``_partial`` while it
    is open, ``_complete`` once ``</tool_call>`` arrived)."""

    def __init__(self, tool_params: Mapping[str, Mapping[str, str]] | None = None) -> None:
        self.tool_params = tool_params or {}  # function -> parameter -> JSON type
        self.num_calls = 0  # calls started (header sent)
        self._buf = ""
        self._in_call = False
        self._header_sent = False
        self._args_sent = ""

    def feed(self, text: str) -> ParsedDelta:
        self._buf += text
        out = ParsedDelta()
        while True:
            if not self._in_call:
                start = self._buf.find(OPEN)
                if start < 0:
                    self._text(out, len(self._buf) - partial_suffix(self._buf, OPEN))
                    return out
                self._text(out, start, before_call=True)
                self._buf = self._buf[len(OPEN) :]
                self._in_call, self._header_sent, self._args_sent = True, False, ""
                continue
            end = self._buf.find(CLOSE)
            if end < 0:
                self._extend(out, self._partial(self._buf[: len(self._buf) - partial_suffix(self._buf, CLOSE)]))
                return out
            body, self._buf = self._buf[:end], self._buf[end + len(CLOSE) :]
            self._in_call = False
            done = self._complete(body)
            if done is None and not self._header_sent:
                out.content += OPEN + body + CLOSE  # not a call after all
            elif done is not None:
                self._extend(out, done)

    def finish(self) -> ParsedDelta:
        """The end of the text: an unclosed call is completed if its body parses, else it
        is content (when nothing of it was streamed)."""
        out = ParsedDelta()
        if self._in_call:
            done = self._complete(self._buf)
            if done is None and not self._header_sent:
                out.content += OPEN + self._buf
            elif done is not None:
                self._extend(out, done)
        elif self.num_calls == 0 or self._buf.strip():
            out.content += self._buf
        self._buf, self._in_call = "", False
        return out

    def _text(self, out: ParsedDelta, end: int, before_call: bool = False) -> None:
        """Release ``_buf[:end]`` as content; after a call, whitespace alone is held (or
        dropped before the next call)."""
        piece = self._buf[:end]
        if self.num_calls and not piece.strip():
            if before_call:
                self._buf = self._buf[end:]
            return
        out.content += piece
        self._buf = self._buf[end:]

    def _extend(self, out: ParsedDelta, call: tuple[str | None, str] | None) -> None:
        """Emit the header (once ``name`` is known) and the new part of ``args``."""
        if call is None:
            return
        name, args = call
        if not self._header_sent:
            if name is None:
                return
            out.tool_calls.append(ToolCallDelta(self.num_calls, new_call_id(), name, ""))
            self._header_sent = True
            self.num_calls += 1
        if args.startswith(self._args_sent) and len(args) > len(self._args_sent):
            out.tool_calls.append(ToolCallDelta(self.num_calls - 1, None, None, args[len(self._args_sent) :]))
            self._args_sent = args

    def _partial(self, body: str) -> tuple[str | None, str] | None:
        """(name or None, arguments text safe to send) of an open call's body so far."""
        raise NotImplementedError

    def _complete(self, body: str) -> tuple[str, str] | None:
        """(name, whole arguments JSON text) of a closed call, None if it is malformed."""
        raise NotImplementedError


_HERMES_HEAD = re.compile(r'^\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


class HermesToolParser(ToolCallParser):
    """A JSON object ``{"name", "arguments"}`` per call. While the call is open, the
    arguments stream as the model writes them (when they are an object and follow the
    name), holding back trailing whitespace and a ``}`` that may close the outer object."""

    def _partial(self, body: str) -> tuple[str | None, str] | None:
        head = _HERMES_HEAD.match(body)
        if head is None:
            return None
        rest = body[head.end() :]
        if not rest.lstrip().startswith("{"):
            return json.loads(head.group(1)), ""
        safe = rest.rstrip()
        if safe.endswith("}"):
            safe = safe[:-1].rstrip()
        return json.loads(head.group(1)), safe

    def _complete(self, body: str) -> tuple[str, str] | None:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        head = _HERMES_HEAD.match(body)
        if head is not None and isinstance(args, dict):
            raw = body[head.end() :].rstrip()[:-1].rstrip()  # the object as written
            if _loads(raw) == args:
                return obj["name"], raw
        if isinstance(args, str) and isinstance(_loads(args), dict):
            return obj["name"], args
        return obj["name"], json.dumps(args, ensure_ascii=False)


_XML_FUNCTION = re.compile(r"<function=([^>\n]+)>")
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


class Qwen3XmlToolParser(ToolCallParser):
    """``<function=NAME>`` then ``<parameter=KEY>VALUE</parameter>`` blocks: each closed
    parameter streams as ``{"key": value`` (then ``, "key": value``), ``</function>`` as ``}``."""

    def _partial(self, body: str) -> tuple[str | None, str] | None:
        fn = _XML_FUNCTION.search(body)
        if fn is None:
            return None
        name = fn.group(1).strip()
        params = _XML_PARAMETER.findall(body, fn.end())
        return name, self._arguments(name, params, closed="</function>" in body)

    def _complete(self, body: str) -> tuple[str, str] | None:
        fn = _XML_FUNCTION.search(body)
        if fn is None:
            return None
        name = fn.group(1).strip()
        return name, self._arguments(name, _XML_PARAMETER.findall(body, fn.end()), closed=True)

    def _arguments(self, name: str, params: list[tuple[str, str]], closed: bool) -> str:
        types = self.tool_params.get(name, {})
        parts = [
            f"{json.dumps(k.strip(), ensure_ascii=False)}: "
            f"{json.dumps(convert_value(v, types.get(k.strip())), ensure_ascii=False)}"
            for k, v in params
        ]
        text = "{" + ", ".join(parts) if parts else ""
        return (text or "{") + "}" if closed else text


def convert_value(raw: str, json_type: str | None) -> Any:
    """A parameter's text as its schema type (one newline each side is framing)."""
    value = raw[1:] if raw.startswith("\n") else raw
    value = value[:-1] if value.endswith("\n") else value
    if json_type in (None, "string"):
        return value
    parsed = _loads(value.strip())
    wanted = {
        "integer": int,
        "number": (int, float),
        "boolean": bool,
        "object": dict,
        "array": list,
        "null": type(None),
    }.get(json_type)
    if wanted is None or parsed is _INVALID or (isinstance(parsed, bool) and json_type != "boolean"):
        return value
    return parsed if isinstance(parsed, wanted) else value


_INVALID = object()


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, ValueError):
        return _INVALID


def parameter_types(tools: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """function name -> parameter -> its JSON type (the first non-null one a schema names)."""
    out: dict[str, dict[str, str]] = {}
    for tool in tools:
        fn = tool.get("function", {})
        props = (fn.get("parameters") or {}).get("properties") or {}
        types: dict[str, str] = {}
        for key, schema in props.items():
            kind = schema.get("type") if isinstance(schema, dict) else None
            if isinstance(kind, list):
                kind = next((k for k in kind if k != "null"), None)
            if isinstance(kind, str):
                types[key] = kind
        out[fn.get("name", "")] = types
    return out


def make_tool_parser(name: str, tool_params: Mapping[str, Mapping[str, str]] | None = None) -> ToolCallParser:
    if name == "hermes":
        return HermesToolParser(tool_params)
    if name == "qwen3_xml":
        return Qwen3XmlToolParser(tool_params)
    raise ValueError(f"unknown tool call parser {name!r}; expected one of {list(PARSERS)}")


def pick_tool_parser(setting: str, chat_template: str | None) -> str | None:
    """The parser for a model: the config's choice, or (``auto``) the format its chat
    template writes tool calls in; None when it shows none (or ``none``)."""
    if setting == "none":
        return None
    if setting != "auto":
        return setting
    template = chat_template or ""
    if "<function=" in template:
        return "qwen3_xml"
    if OPEN in template:
        return "hermes"
    return None
