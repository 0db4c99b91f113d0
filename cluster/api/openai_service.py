"""OpenAI semantics shared by run-batch and the HTTP ingress: requests in, bodies out.

``prepare_*`` turns a validated request into token ids and per-choice SamplingParams,
raising ``OpenAIError`` (a 4xx) for anything the engine would refuse, so errors surface
before any generation or stream starts. ``*_body`` renders finished outputs. Chat outputs
are read as ``PreparedRequest.chat`` says (reasoning, tool calls: ``chat_output``).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

from cluster.api.chat_output import ChatOutputSpec, parse_message
from cluster.api.chat_prompt import ChatSetup, chat_output_spec, render_chat
from cluster.api.errors import OpenAIError
from cluster.api.logprobs import chat_logprobs, completion_logprobs
from cluster.api.prompt_logprobs import echo_logprobs, vllm_prompt_logprobs
from cluster.api.protocol import ChatCompletionRequest, CompletionRequest
from cluster.api.sampling_fields import ConstraintError
from cluster.api.tool_choice import forced_schema
from workers.outputs import RequestOutput
from workers.sampling.params import SamplingParams, nth_seed
from workers.sampling.structured import StructuredOutput

MIN_TEMPERATURE = 1e-5  # below it sampling is greedy (as vLLM)
MIN_TOP_P = 1e-8  # the same nucleus (top-1) for any smaller top_p


@dataclass(frozen=True)
class PreparedRequest:
    kind: str  # "completion" | "chat"
    prompt_ids: list[list[int]]  # one per prompt
    params: list[SamplingParams]  # one per choice: prompt i, choice j -> i * n + j
    n: int  # sequences run per prompt (best_of when given)
    return_token_ids: bool
    logprobs: int | None
    tokens_as_ids: bool = False  # return_tokens_as_token_ids
    chat: ChatOutputSpec | None = None  # how a chat output is read (None: all content)
    prompt_texts: tuple[str, ...] = ()  # per prompt: for echo and text-based routers
    echo: bool = False  # completions: the prompt (and its logprobs) first
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs field, top-k per position
    keep: int | None = None  # best_of: the n choices returned per prompt

    def choice_prompts(self) -> list[list[int]]:
        return [ids for ids in self.prompt_ids for _ in range(self.n)]

    def kept(self) -> PreparedRequest:
        """What the body renders once the best ``keep`` of ``n`` sequences are chosen."""
        return self if self.keep is None else replace(self, n=self.keep, keep=None)


def _extras(req: CompletionRequest | ChatCompletionRequest, vocab_size: int) -> dict[str, Any]:
    """The SamplingParams of the ``SamplingExtras`` fields (once per request: a schema compiles once)."""
    try:
        extras = req.sampling_kwargs()
    except ConstraintError as exc:
        raise OpenAIError(str(exc), param=exc.param) from None
    bad = [t for t in extras["logit_bias"] if t >= vocab_size]
    if bad:
        raise OpenAIError(
            f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})", param="logit_bias"
        )
    return extras


def _runs(req: CompletionRequest | ChatCompletionRequest) -> int:
    """Sequences per prompt: best_of (>= n) or n; best_of > n is not streamed (OpenAI)."""
    best_of = req.best_of or req.n
    if best_of < req.n:
        raise OpenAIError(f"best_of={best_of} must be >= n={req.n}", param="best_of")
    if best_of > req.n and req.stream:
        raise OpenAIError("best_of > n cannot be streamed", param="best_of")
    return best_of


def _sampling(
    req: CompletionRequest | ChatCompletionRequest,
    prompt_len: int,
    max_model_len: int,
    logprobs: int | None,
    choice: int,
    extras: dict[str, Any],
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    room = max_model_len - prompt_len
    max_tokens = req.max_tokens if req.max_tokens is not None else room  # vLLM: the rest of the context
    if prompt_len >= max_model_len or max_tokens > room:
        raise OpenAIError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
            f"{max_tokens} in the completion).",
            param="max_tokens" if prompt_len < max_model_len else "prompt",
            code="context_length_exceeded",
        )
    seed = nth_seed(req.seed, choice)
    # logits / 1e-45 overflows to inf and the sampler's softmax to NaN: tiny is greedy
    # and a top_p that rounds to 0 in float32 masks every token: clamp both at the edge
    temperature = 0.0 if req.temperature < MIN_TEMPERATURE else req.temperature
    best_of = req.best_of if (req.best_of or 1) > req.n else None  # ranked: cumulative logprobs
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=max(req.top_p, MIN_TOP_P),
        top_k=req.top_k,
        seed=seed,
        stop=tuple(req.stop or ()),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        min_tokens=min(req.min_tokens, max_tokens),
        prompt_logprobs=prompt_logprobs,
        best_of=best_of,
        **extras,
    )


def _check_ids(ids: list[int], vocab_size: int) -> None:
    if not ids:
        raise OpenAIError("prompt must contain at least one token", param="prompt")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise OpenAIError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})", param="prompt")


def _truncate(ids: list[int], keep: int | None) -> list[int]:
    """``truncate_prompt_tokens``: the last ``keep`` tokens (vLLM truncates on the left)."""
    return ids[-keep:] if keep is not None and len(ids) > keep else ids


def prepare_completion(
    req: CompletionRequest, tokenizer: Any, max_model_len: int, vocab_size: int, setup: ChatSetup | None = None
) -> PreparedRequest:
    prompt_ids, texts = [], []
    for p in req.prompts():
        ids = list(tokenizer.encode(p, add_special_tokens=req.add_special_tokens)) if isinstance(p, str) else list(p)
        _check_ids(ids, vocab_size)
        kept = _truncate(ids, req.truncate_prompt_tokens)
        prompt_ids.append(kept)
        text = p if isinstance(p, str) else ""
        if req.echo and not (isinstance(p, str) and kept is ids):
            text = tokenizer.decode(kept)  # echo shows what the model saw (token or truncated prompts)
        texts.append(text)
    if req.max_tokens == 0 and not (req.echo or req.prompt_logprobs is not None):
        raise OpenAIError("max_tokens: 0 generates nothing; it needs echo or prompt_logprobs", param="max_tokens")
    extras, runs = _extras(req, vocab_size), _runs(req)
    # echo with logprobs scores the prompt too, with as many alternatives
    scored = [k for k in (req.prompt_logprobs, req.logprobs if req.echo else None) if k is not None]
    k = max(scored) if scored else None
    params = [
        _sampling(req, len(ids), max_model_len, req.logprobs, j, extras, k) for ids in prompt_ids for j in range(runs)
    ]
    return PreparedRequest(
        "completion",
        prompt_ids,
        params,
        runs,
        req.return_token_ids,
        req.logprobs,
        req.return_tokens_as_token_ids,
        prompt_texts=tuple(texts),
        echo=req.echo,
        prompt_logprobs=req.prompt_logprobs,
        keep=req.n if runs != req.n else None,
    )


def _tool_constraint(req: ChatCompletionRequest, spec: ChatOutputSpec, extras: dict[str, Any]) -> dict[str, Any]:
    """``tool_choice`` required / named: the JSON schema the output must follow, as the
    request's one structured-output constraint."""
    if not spec.forced:
        return extras
    if extras.get("structured_output") is not None:
        raise OpenAIError(
            "tool_choice required or a named function cannot be combined with another structured-output constraint",
            param="tool_choice",
        )
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    schema = forced_schema(tools, spec.forced_name, req.parallel_tool_calls)
    try:
        # compact: no whitespace runs
        constraint = StructuredOutput.json_schema(schema, any_whitespace=False)
    except ValueError as exc:
        raise OpenAIError(f"the tools' parameters schemas do not compile: {exc}", param="tools") from None
    return {**extras, "structured_output": constraint}


def prepare_chat(
    req: ChatCompletionRequest, tokenizer: Any, max_model_len: int, vocab_size: int, setup: ChatSetup | None = None
) -> PreparedRequest:
    setup = setup or ChatSetup.for_tokenizer(tokenizer)
    rendered = render_chat(req, tokenizer, setup)
    spec = chat_output_spec(req, rendered, setup)
    ids = _truncate(rendered.prompt_ids, req.truncate_prompt_tokens)
    _check_ids(ids, vocab_size)
    lp = (req.top_logprobs or 0) if req.logprobs else None
    extras, runs = _tool_constraint(req, spec, _extras(req, vocab_size)), _runs(req)
    params = [_sampling(req, len(ids), max_model_len, lp, j, extras, req.prompt_logprobs) for j in range(runs)]
    return PreparedRequest(
        "chat",
        [ids],
        params,
        runs,
        req.return_token_ids,
        lp,
        req.return_tokens_as_token_ids,
        spec if spec.parses else None,
        (rendered.text,),
        prompt_logprobs=req.prompt_logprobs,
        keep=req.n if runs != req.n else None,
    )


def usage(prepared: PreparedRequest, outputs: list[RequestOutput]) -> dict[str, Any]:
    prompt_tokens = sum(len(ids) for ids in prepared.prompt_ids)
    completion = sum(len(o.token_ids) for o in outputs)
    cached = sum(o.cached_tokens for i, o in enumerate(outputs) if i % prepared.n == 0)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def chat_finish_reason(reason: str | None, called_tools: bool) -> str | None:
    """OpenAI's ``tool_calls`` when a choice ended by itself after calling tools."""
    return "tool_calls" if called_tools and reason == "stop" else reason


def completion_body(
    prepared: PreparedRequest, outputs: list[RequestOutput], model: str, tokenizer: Any, request_id: str | None = None
) -> dict[str, Any]:
    choices = []
    for i, out in enumerate(outputs):
        choice: dict[str, Any] = {
            "index": i,
            "text": out.text,
            "finish_reason": out.finish_reason,
            "stop_reason": out.stop_reason,
            "logprobs": None,
        }
        if prepared.logprobs is not None and out.logprobs is not None:
            choice["logprobs"] = completion_logprobs(out.logprobs, tokenizer, as_ids=prepared.tokens_as_ids)
        if prepared.echo:
            echo_choice(choice, prepared, i // prepared.n, out, tokenizer)
        if prepared.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(
                out.prompt_logprobs or [], prepared.prompt_logprobs, tokenizer
            )
        if prepared.return_token_ids:
            choice["token_ids"] = out.token_ids
            choice["prompt_token_ids"] = out.prompt_token_ids
        choices.append(choice)
    body = {
        "id": request_id or f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(prepared, outputs),
    }
    if prepared.return_token_ids:
        ids = prepared.prompt_ids
        body["prompt_token_ids"] = ids[0] if len(ids) == 1 else ids
    return body


def echo_choice(
    choice: dict[str, Any], prepared: PreparedRequest, prompt: int, out: RequestOutput, tokenizer: Any
) -> None:
    """Put the prompt in front of a completions choice's text and logprobs (``echo``)."""
    text = prepared.prompt_texts[prompt]
    choice["text"] = text + choice["text"]
    if prepared.logprobs is None:
        return
    head = echo_logprobs(prepared.prompt_ids[prompt], out.prompt_logprobs or [], prepared.logprobs, tokenizer)
    tail = choice["logprobs"] or completion_logprobs([], tokenizer)
    tail_offsets = [o + len(text) for o in tail["text_offset"]]
    choice["logprobs"] = {
        key: [*head[key], *(tail_offsets if key == "text_offset" else tail[key])]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    }


def chat_body(
    prepared: PreparedRequest, outputs: list[RequestOutput], model: str, tokenizer: Any, request_id: str | None = None
) -> dict[str, Any]:
    choices = []
    for i, out in enumerate(outputs):
        message, called = (
            ({"role": "assistant", "content": out.text}, False)
            if prepared.chat is None
            else parse_message(prepared.chat, out.text)
        )
        choice: dict[str, Any] = {
            "index": i,
            "message": message,
            "logprobs": None,
            "finish_reason": chat_finish_reason(out.finish_reason, called),
            "stop_reason": out.stop_reason,
        }
        if prepared.logprobs is not None and out.logprobs is not None:
            choice["logprobs"] = chat_logprobs(out.logprobs, tokenizer, prepared.tokens_as_ids)
        if prepared.return_token_ids:
            choice["token_ids"] = out.token_ids
        choices.append(choice)
    body = {
        "id": request_id or f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(prepared, outputs),
    }
    if prepared.prompt_logprobs is not None and outputs:
        body["prompt_logprobs"] = vllm_prompt_logprobs(
            outputs[0].prompt_logprobs or [], prepared.prompt_logprobs, tokenizer
        )
    if prepared.return_token_ids:
        body["prompt_token_ids"] = prepared.prompt_ids[0]
    return body
