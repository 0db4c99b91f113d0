"""Turning replica chunks into OpenAI responses: accumulation and SSE rendering (no Ray).

``ResponseState`` accumulates the ``GenerateChunk``s of every choice of a request (choice
``i * n + j`` is prompt i, choice j). It yields merged per-choice deltas for streaming and,
at the end, ``RequestOutput``s for the non-streaming bodies of ``openai_service``.

``SSERenderer`` renders OpenAI stream events: ``data: <json>\\n\\n`` each, chat's first
delta per choice carrying ``role``, ``finish_reason`` on a choice's last content chunk,
an optional usage chunk (``stream_options.include_usage``: empty ``choices``; every
other chunk then has ``"usage": null``, or the usage so far with
``continuous_usage_stats``), and ``data: [DONE]`` last. A chat choice whose output is
parsed (``PreparedRequest.chat``) streams ``reasoning_content``, ``content`` and
``tool_calls`` deltas from its own ``ChatOutputParser``; one that called tools finishes
with ``tool_calls``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cluster.api.chat_output import ChatOutputParser, MessageDelta
from cluster.api.errors import OpenAIError
from cluster.api.logprobs import chat_logprobs, completion_logprobs_from
from cluster.api.openai_service import PreparedRequest, chat_finish_reason, echo_choice, usage
from cluster.api.prompt_logprobs import vllm_prompt_logprobs
from cluster.serving.messages import GenerateChunk
from workers.outputs import RequestOutput
from workers.request import TokenLogprob

DONE_EVENT = "data: [DONE]\n\n"


@dataclass
class ChoiceState:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cumulative_logprob: float | None = None


@dataclass(frozen=True)
class ChoiceDelta:
    """Everything one choice gained from one batch of chunks."""

    index: int  # global choice index in the response
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    stop_reason: str | int | None
    is_first: bool  # the choice's first delta
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on the first delta, when asked


class ResponseState:
    def __init__(self, prepared: PreparedRequest) -> None:
        self.prepared = prepared
        self.choices = [ChoiceState(list(ids)) for ids in prepared.choice_prompts()]
        self._started = [False] * len(self.choices)

    def absorb(self, prompt_index: int, chunks: Sequence[GenerateChunk]) -> list[ChoiceDelta]:
        """Apply a batch of chunks from prompt ``prompt_index``'s stream; merged deltas out."""
        merged: dict[int, list[GenerateChunk]] = {}
        for chunk in chunks:
            merged.setdefault(prompt_index * self.prepared.n + chunk.index, []).append(chunk)
        return [self._apply(i, group) for i, group in sorted(merged.items())]

    def _apply(self, i: int, group: list[GenerateChunk]) -> ChoiceDelta:
        state = self.choices[i]
        ids = [t for c in group for t in c.new_token_ids]
        text = "".join(c.delta_text for c in group)
        lps = None
        if any(c.logprobs is not None for c in group):
            lps = [lp for c in group for lp in (c.logprobs or [])]
            state.logprobs = (state.logprobs or []) + lps
        last = group[-1]
        prompt_lps = next((c.prompt_logprobs for c in group if c.prompt_logprobs is not None), None)
        if prompt_lps is not None:
            state.prompt_logprobs = prompt_lps
        state.cumulative_logprob = last.cumulative_logprob
        state.token_ids.extend(ids)
        state.text += text
        state.cached_tokens = max(state.cached_tokens, last.cached_tokens)
        if last.finished:
            state.finished = True
            state.finish_reason, state.stop_reason = last.finish_reason, last.stop_reason
        first = not self._started[i]
        self._started[i] = True
        return ChoiceDelta(
            i,
            ids,
            text,
            lps,
            last.finish_reason if last.finished else None,
            last.stop_reason if last.finished else None,
            first,
            state.prompt_logprobs,
        )

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)

    def outputs(self) -> list[RequestOutput]:
        return [
            RequestOutput(
                request_id=str(i),
                prompt_token_ids=c.prompt_token_ids,
                token_ids=list(c.token_ids),
                text=c.text,
                cached_tokens=c.cached_tokens,
                finished=c.finished,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                new_token_ids=[],
                delta_text="",
                logprobs=c.logprobs,
                prompt_logprobs=c.prompt_logprobs,
                cumulative_logprob=c.cumulative_logprob,
            )
            for i, c in enumerate(self.choices)
        ]

    def usage(self) -> dict[str, Any]:
        return usage(self.prepared, self.outputs())


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class SSERenderer:
    def __init__(
        self,
        prepared: PreparedRequest,
        model: str,
        request_id: str,
        tokenizer: Any,
        include_usage: bool,
        created: int | None = None,
        continuous_usage: bool = False,
    ) -> None:
        self.prepared = prepared
        self.chat = prepared.kind == "chat"
        self.model = model
        self.request_id = request_id
        self.tokenizer = tokenizer
        self.include_usage = include_usage
        self.continuous_usage = include_usage and continuous_usage
        self.created = int(time.time()) if created is None else created
        spec = prepared.chat
        num_choices = len(prepared.prompt_ids) * prepared.n
        self._parsers = [ChatOutputParser(spec) for _ in range(num_choices)] if spec is not None else None
        self._lp_offsets = [0] * num_choices  # completions: where the next token's text_offset starts

    def _envelope(self, choices: list[dict[str, Any]], state: ResponseState | None = None) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "id": self.request_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            obj["usage"] = state.usage() if self.continuous_usage and state is not None else None
        return obj

    def first_events(self, num_choices: int) -> list[str]:
        """Chat opens every choice with an empty assistant delta; completions send nothing."""
        if not self.chat:
            return []
        return [
            sse(
                self._envelope(
                    [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )
            )
            for i in range(num_choices)
        ]

    def delta_events(self, deltas: Sequence[ChoiceDelta], state: ResponseState | None = None) -> list[str]:
        events = []
        for d in deltas:
            delta = self._chat_delta(d) if self.chat else {}
            opens = d.is_first and (self.prepared.echo or self.prepared.prompt_logprobs is not None)
            if not (
                delta or d.text and not self.chat or d.finish_reason or opens or (d.token_ids and self._shows_tokens())
            ):
                continue  # nothing a client could see (held-back text)
            events.append(sse(self._envelope([self._choice(d, delta)], state)))
        return events

    def _shows_tokens(self) -> bool:
        return self.prepared.return_token_ids or self.prepared.logprobs is not None

    def _chat_delta(self, d: ChoiceDelta) -> dict[str, Any]:
        if self._parsers is None:
            return {"content": d.text} if d.text else {}
        parser = self._parsers[d.index]
        parsed = parser.feed(d.text)
        if d.finish_reason is not None:
            end = parser.finish()
            parsed = MessageDelta(
                parsed.reasoning + end.reasoning, parsed.content + end.content, parsed.tool_calls + end.tool_calls
            )
        return parsed.openai_delta()

    def _choice(self, d: ChoiceDelta, delta: dict[str, Any]) -> dict[str, Any]:
        want_lps = self.prepared.logprobs is not None and d.logprobs is not None
        as_ids = self.prepared.tokens_as_ids
        if self.chat:
            called = self._parsers is not None and self._parsers[d.index].called_tools
            choice: dict[str, Any] = {
                "index": d.index,
                "delta": delta,
                "logprobs": chat_logprobs(d.logprobs, self.tokenizer, as_ids) if want_lps else None,  # type: ignore[arg-type]
                "finish_reason": chat_finish_reason(d.finish_reason, called),
            }
            if d.finish_reason is not None:
                choice["stop_reason"] = d.stop_reason
        else:
            lps = None
            if want_lps:
                lps, self._lp_offsets[d.index] = completion_logprobs_from(
                    d.logprobs, self.tokenizer, self._lp_offsets[d.index], as_ids
                )  # type: ignore[arg-type]
            choice = {
                "index": d.index,
                "text": d.text,
                "logprobs": lps,
                "finish_reason": d.finish_reason,
                "stop_reason": d.stop_reason,
            }
            self._echo(choice, d)
        if d.is_first and self.prepared.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(
                d.prompt_logprobs or [], self.prepared.prompt_logprobs, self.tokenizer
            )
        if self.prepared.return_token_ids:
            choice["token_ids"] = d.token_ids
            if d.is_first:
                choice["prompt_token_ids"] = self.prepared.prompt_ids[d.index // self.prepared.n]
        return choice

    def _echo(self, choice: dict[str, Any], d: ChoiceDelta) -> None:
        """Completions ``echo``: the prompt opens the choice's first chunk; later offsets
        count it too."""
        if not self.prepared.echo:
            return
        prompt = d.index // self.prepared.n
        if d.is_first:
            out = RequestOutput(
                str(d.index),
                self.prepared.prompt_ids[prompt],
                [],
                "",
                0,
                False,
                None,
                None,
                [],
                "",
                d.logprobs,
                prompt_logprobs=d.prompt_logprobs,
            )
            echo_choice(choice, self.prepared, prompt, out, self.tokenizer)
        elif choice["logprobs"] is not None:
            shift = len(self.prepared.prompt_texts[prompt])
            choice["logprobs"]["text_offset"] = [o + shift for o in choice["logprobs"]["text_offset"]]

    def final_events(self, state: ResponseState) -> list[str]:
        events = []
        if self.include_usage:
            obj = self._envelope([])
            obj["usage"] = state.usage()
            events.append(sse(obj))
        events.append(DONE_EVENT)
        return events

    def error_events(self, err: OpenAIError) -> list[str]:
        """A failure after the stream started: an error event, then [DONE]."""
        return [sse(err.body()), DONE_EVENT]
