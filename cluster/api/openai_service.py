"""OpenAI semantics shared by run-batch and the HTTP ingress: requests in, bodies out.

``prepare_*`` turns a validated request into token ids and per-choice SamplingParams,
raising ``OpenAIError`` (a 4xx) for anything the engine would refuse, so errors surface
before any generation or stream starts. ``*_body`` renders finished outputs. Chat outputs
are read as ``PreparedRequest.chat`` says (reasoning, tool calls: ``chat_output``).
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from cluster.api.chat_output import ChatOutputSpec, parse_message
from cluster.api.chat_prompt import ChatSetup, chat_output_spec, render_chat
from cluster.api.errors import OpenAIError
from cluster.api.logprobs import chat_logprobs, completion_logprobs
from cluster.api.protocol import ChatCompletionRequest, CompletionRequest
from workers.outputs import RequestOutput
from workers.sampling_params import SamplingParams

MIN_TEMPERATURE = 1e-5                     # below it sampling is greedy (as vLLM)
MIN_TOP_P = 1e-8                           # the same nucleus (top-1) for any smaller top_p


@dataclass(frozen=True)
class PreparedRequest:
    kind: str                              # "completion" | "chat"
    prompt_ids: list[list[int]]            # one per prompt
    params: list[SamplingParams]           # one per choice: prompt i, choice j -> i * n + j
    n: int
    return_token_ids: bool
    logprobs: int | None
    tokens_as_ids: bool = False            # return_tokens_as_token_ids
    chat: ChatOutputSpec | None = None     # how a chat output is read (None: all content)
    prompt_texts: tuple[str, ...] = ()     # per prompt, when known (text-based routers)

    def choice_prompts(self) -> list[list[int]]:
        return [ids for ids in self.prompt_ids for _ in range(self.n)]


def _sampling(req: CompletionRequest | ChatCompletionRequest, prompt_len: int, max_model_len: int,
              logprobs: int | None, choice: int) -> SamplingParams:
    room = max_model_len - prompt_len
    max_tokens = req.max_tokens if req.max_tokens is not None else room   # vLLM: the rest of the context
    if prompt_len >= max_model_len or max_tokens > room:
        raise OpenAIError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
            f"{max_tokens} in the completion).", param="max_tokens" if prompt_len < max_model_len else "prompt",
            code="context_length_exceeded")
    seed = None if req.seed is None else req.seed + choice
    # logits / 1e-45 overflows to inf and the sampler's softmax to NaN: tiny is greedy
    # and a top_p that rounds to 0 in float32 masks every token: clamp both at the edge
    temperature = 0.0 if req.temperature < MIN_TEMPERATURE else req.temperature
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=max(req.top_p, MIN_TOP_P),
                          top_k=req.top_k, seed=seed, stop=tuple(req.stop or ()),
                          stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
                          logprobs=logprobs, min_tokens=min(req.min_tokens, max_tokens))


def _check_ids(ids: list[int], vocab_size: int) -> None:
    if not ids:
        raise OpenAIError("prompt must contain at least one token", param="prompt")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise OpenAIError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})", param="prompt")


def _truncate(ids: list[int], keep: int | None) -> list[int]:
    """``truncate_prompt_tokens``: the last ``keep`` tokens (vLLM truncates on the left)."""
    return ids[-keep:] if keep is not None and len(ids) > keep else ids


def prepare_completion(req: CompletionRequest, tokenizer: Any, max_model_len: int,
                       vocab_size: int, setup: ChatSetup | None = None) -> PreparedRequest:
    prompt_ids, texts = [], []
    for p in req.prompts():
        ids = (list(tokenizer.encode(p, add_special_tokens=req.add_special_tokens)) if isinstance(p, str)
               else list(p))
        _check_ids(ids, vocab_size)
        prompt_ids.append(_truncate(ids, req.truncate_prompt_tokens))
        texts.append(p if isinstance(p, str) else "")
    params = [_sampling(req, len(ids), max_model_len, req.logprobs, j)
              for ids in prompt_ids for j in range(req.n)]
    return PreparedRequest("completion", prompt_ids, params, req.n, req.return_token_ids, req.logprobs,
                           req.return_tokens_as_token_ids, prompt_texts=tuple(texts))


def prepare_chat(req: ChatCompletionRequest, tokenizer: Any, max_model_len: int,
                 vocab_size: int, setup: ChatSetup | None = None) -> PreparedRequest:
    setup = setup or ChatSetup.for_tokenizer(tokenizer)
    rendered = render_chat(req, tokenizer, setup)
    spec = chat_output_spec(req, rendered, setup)
    ids = _truncate(rendered.prompt_ids, req.truncate_prompt_tokens)
    _check_ids(ids, vocab_size)
    lp = (req.top_logprobs or 0) if req.logprobs else None
    params = [_sampling(req, len(ids), max_model_len, lp, j) for j in range(req.n)]
    return PreparedRequest("chat", [ids], params, req.n, req.return_token_ids, lp,
                           req.return_tokens_as_token_ids, spec if spec.parses else None, (rendered.text,))


def usage(prepared: PreparedRequest, outputs: list[RequestOutput]) -> dict[str, Any]:
    prompt_tokens = sum(len(ids) for ids in prepared.prompt_ids)
    completion = sum(len(o.token_ids) for o in outputs)
    cached = sum(o.cached_tokens for i, o in enumerate(outputs) if i % prepared.n == 0)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def chat_finish_reason(reason: str | None, called_tools: bool) -> str | None:
    """OpenAI's ``tool_calls`` when a choice ended by itself after calling tools."""
    return "tool_calls" if called_tools and reason == "stop" else reason


def completion_body(prepared: PreparedRequest, outputs: list[RequestOutput], model: str,
                    tokenizer: Any, request_id: str | None = None) -> dict[str, Any]:
    choices = []
    for i, out in enumerate(outputs):
        choice: dict[str, Any] = {"index": i, "text": out.text, "finish_reason": out.finish_reason,
                                  "stop_reason": out.stop_reason, "logprobs": None}
        if prepared.logprobs is not None and out.logprobs is not None:
            choice["logprobs"] = completion_logprobs(out.logprobs, tokenizer, as_ids=prepared.tokens_as_ids)
        if prepared.return_token_ids:
            choice["token_ids"] = out.token_ids
            choice["prompt_token_ids"] = out.prompt_token_ids
        choices.append(choice)
    body = {"id": request_id or f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": model, "choices": choices,
            "usage": usage(prepared, outputs)}
    if prepared.return_token_ids:
        body["prompt_token_ids"] = prepared.prompt_ids[0] if len(prepared.prompt_ids) == 1 else prepared.prompt_ids
    return body


def chat_body(prepared: PreparedRequest, outputs: list[RequestOutput], model: str,
              tokenizer: Any, request_id: str | None = None) -> dict[str, Any]:
    choices = []
    for i, out in enumerate(outputs):
        message, called = ({"role": "assistant", "content": out.text}, False) if prepared.chat is None \
            else parse_message(prepared.chat, out.text)
        choice: dict[str, Any] = {"index": i, "message": message, "logprobs": None,
                                  "finish_reason": chat_finish_reason(out.finish_reason, called),
                                  "stop_reason": out.stop_reason}
        if prepared.logprobs is not None and out.logprobs is not None:
            choice["logprobs"] = chat_logprobs(out.logprobs, tokenizer, prepared.tokens_as_ids)
        if prepared.return_token_ids:
            choice["token_ids"] = out.token_ids
        choices.append(choice)
    body = {"id": request_id or f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": model, "choices": choices,
            "usage": usage(prepared, outputs)}
    if prepared.return_token_ids:
        body["prompt_token_ids"] = prepared.prompt_ids[0]
    return body
