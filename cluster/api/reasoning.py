"""``<think>`` reasoning split from the answer, incrementally (Qwen3, Qwen3.5, DeepSeek-R1 style).

Where the output starts is read from the prompt: a chat template that opens the think
block itself (Qwen3.5, or Qwen3 thinking models: the generation prompt ends in an unclosed
``<think>``) makes the output start inside the reasoning; otherwise reasoning starts only
if the output opens with ``<think>`` (leading whitespace allowed). Reasoning ends at
``</think>``; whitespace right after it, and at the start of the reasoning, is dropped.
An output with no ``<think>`` where one could start is all content; one cut off before
``</think>`` is all reasoning.

``feed`` returns (reasoning, content) text released so far, holding back a possible
partial tag; ``finish`` releases the rest. Any split of the text gives the same result.
"""

from __future__ import annotations

from cluster.api.tool_parsers import partial_suffix

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
PARSERS = ("qwen3",)


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """True when the prompt ends inside an open think block."""
    return prompt_text.rfind(THINK_OPEN) > prompt_text.rfind(THINK_CLOSE)


class ReasoningSplitter:
    def __init__(self, starts_in_reasoning: bool) -> None:
        self._state = "reasoning_start" if starts_in_reasoning else "start"
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning, content = "", ""
        while True:
            state = self._state
            if state == "start":
                head = self._buf.lstrip()
                if head.startswith(THINK_OPEN):
                    self._buf, self._state = head[len(THINK_OPEN) :], "reasoning_start"
                    continue
                if THINK_OPEN.startswith(head):  # undecided: empty or a partial tag
                    return reasoning, content
                self._state = "content"
            elif state in ("reasoning_start", "after"):  # drop leading whitespace
                head = self._buf.lstrip()
                if not head:
                    self._buf = ""
                    return reasoning, content
                self._buf, self._state = head, "reasoning" if state == "reasoning_start" else "content"
            elif state == "reasoning":
                end = self._buf.find(THINK_CLOSE)
                if end >= 0:
                    reasoning += self._buf[:end]
                    self._buf, self._state = self._buf[end + len(THINK_CLOSE) :], "after"
                    continue
                keep = partial_suffix(self._buf, THINK_CLOSE)
                reasoning += self._buf[: len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep :]
                return reasoning, content
            else:
                content += self._buf
                self._buf = ""
                return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self._buf = self._buf, ""
        if self._state == "reasoning":
            return rest, ""
        if self._state in ("start", "content"):
            return "", rest
        return "", ""
