"""A chat choice's text as an assistant message: reasoning, content and tool calls.

``ChatOutputSpec`` (decided when the prompt is rendered, ``chat_prompt``) says how to read
the output; ``ChatOutputParser`` applies it to text deltas (reasoning split first, then
tool calls in what follows the reasoning) and ``parse_message`` to a whole text. Both go
through the same incremental parsers, so a streamed choice and the same choice returned
whole carry the same reasoning, content and tool calls (ids aside).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cluster.api.reasoning import ReasoningSplitter
from cluster.api.tool_choice import ForcedToolParser
from cluster.api.tool_parsers import ToolCallDelta, ToolCallParser, make_tool_parser


@dataclass(frozen=True)
class ChatOutputSpec:
    reasoning: bool = False  # split <think> reasoning from the answer
    starts_in_reasoning: bool = False  # the prompt left a think block open
    include_reasoning: bool = True  # False: reasoning is parsed and dropped
    tool_parser: str | None = None  # parse tool calls in this format (tool_choice auto)
    tool_params: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    parallel_tool_calls: bool = True  # False: only the first call is returned
    forced: bool = False  # the output is constrained JSON (tool_choice.forced_schema)
    forced_name: str | None = None  # ... the arguments of this function; None: required

    @property
    def parses(self) -> bool:
        return self.reasoning or self.tool_parser is not None or self.forced


@dataclass
class MessageDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def openai_delta(self) -> dict[str, Any]:
        """The ``delta`` of a chat stream chunk."""
        out: dict[str, Any] = {}
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        if self.content:
            out["content"] = self.content
        if self.tool_calls:
            out["tool_calls"] = [_call_delta(c) for c in self.tool_calls]
        return out


def _call_delta(c: ToolCallDelta) -> dict[str, Any]:
    if c.id is None:
        return {"index": c.index, "function": {"arguments": c.arguments}}
    return {"index": c.index, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


class ChatOutputParser:
    def __init__(self, spec: ChatOutputSpec) -> None:
        self.spec = spec
        self._reasoning = ReasoningSplitter(spec.starts_in_reasoning) if spec.reasoning else None
        self._tools: ToolCallParser | ForcedToolParser | None = None
        if spec.forced:
            self._tools = ForcedToolParser(spec.forced_name)
        elif spec.tool_parser:
            self._tools = make_tool_parser(spec.tool_parser, spec.tool_params)

    @property
    def called_tools(self) -> bool:
        """The model chose to call tools (``finish_reason: tool_calls``); a named function
        the request forced is not a choice (OpenAI finishes those with ``stop``)."""
        return self._tools is not None and self._tools.num_calls > 0 and self.spec.forced_name is None

    def feed(self, text: str) -> MessageDelta:
        reasoning, content = self._reasoning.feed(text) if self._reasoning else ("", text)
        return self._delta(reasoning, content, final=False)

    def finish(self) -> MessageDelta:
        reasoning, content = self._reasoning.finish() if self._reasoning else ("", "")
        return self._delta(reasoning, content, final=True)

    def _delta(self, reasoning: str, content: str, final: bool) -> MessageDelta:
        out = MessageDelta(reasoning if self.spec.include_reasoning else "", content)
        if self._tools is not None:
            parsed = self._tools.feed(content)
            if final:
                end = self._tools.finish()
                parsed.content += end.content
                parsed.tool_calls += end.tool_calls
            out.content = parsed.content
            out.tool_calls = [c for c in parsed.tool_calls if self.spec.parallel_tool_calls or c.index == 0]
        return out


def parse_message(spec: ChatOutputSpec, text: str) -> tuple[dict[str, Any], bool]:
    """The assistant ``message`` of a whole output, and whether it called tools."""
    parser = ChatOutputParser(spec)
    deltas = [parser.feed(text), parser.finish()]
    content = "".join(d.content for d in deltas)
    calls: dict[int, dict[str, Any]] = {}
    for c in (c for d in deltas for c in d.tool_calls):
        if c.id is not None:
            calls[c.index] = {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}}
        calls[c.index]["function"]["arguments"] += c.arguments
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
        if not content.strip():
            message["content"] = None
    if spec.reasoning:
        reasoning = "".join(d.reasoning for d in deltas)
        message["reasoning_content"] = reasoning if spec.include_reasoning and reasoning else None
    return message, parser.called_tools
