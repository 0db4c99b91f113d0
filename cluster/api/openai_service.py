"""OpenAI semantics shared by run-batch and the HTTP ingress: requests in, bodies out.

``prepare_*`` turns a validated request into token ids and per-choice SamplingParams,
raising ``OpenAIError`` (a 4xx) for anything the engine would refuse, so errors surface
before any generation or stream starts. ``*_body`` renders finished outputs.
"""
from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from cluster.api.protocol import ChatCompletionRequest, CompletionRequest
from workers.outputs import RequestOutput
from workers.request import TokenLogprob
from workers.sampling_params import SamplingParams

MIN_TEMPERATURE = 1e-5                     # below it sampling is greedy (as vLLM)
MIN_TOP_P = 1e-8                           # the same nucleus (top-1) for any smaller top_p


class OpenAIError(Exception):
    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


# pydantic names the member of a union in ``loc`` (``("stop", "list[constrained-str]")``)
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list|dict)$|\[|^[a-z]+-[a-z-]+$")


def from_validation_error(exc: ValidationError) -> OpenAIError:
    """The first invalid field as a 400; ``param`` is its dotted path.

    A union field fails once per member: a constraint a member of the right type broke
    says more than "should be a valid string" from the others, so it wins; when every
    member refused the type, the message lists what would have been accepted.
    """
    errors = exc.errors()
    field = errors[0]["loc"][:1]
    same = [e for e in errors if e["loc"][:1] == field]
    broken = [e for e in same if not e["type"].endswith(("_type", "_parsing"))]
    err = broken[0] if broken else same[0]
    param = ".".join(str(p) for p in err["loc"] if not _UNION_TAG.search(str(p))) or None
    msg = err["msg"].removeprefix("Value error, ")
    if not broken and len(same) > 1:
        msg = " or ".join(dict.fromkeys(e["msg"] for e in same))
    return OpenAIError(f"{param}: {msg}" if param else msg, param=param)


@dataclass(frozen=True)
class PreparedRequest:
    kind: str                              # "completion" | "chat"
    prompt_ids: list[list[int]]            # one per prompt
    params: list[SamplingParams]           # one per choice: prompt i, choice j -> i * n + j
    n: int
    return_token_ids: bool
    logprobs: int | None

    def choice_prompts(self) -> list[list[int]]:
        return [ids for ids in self.prompt_ids for _ in range(self.n)]


def _sampling(req: CompletionRequest | ChatCompletionRequest, prompt_len: int, max_model_len: int,
              logprobs: int | None, choice: int) -> SamplingParams:
    room = max_model_len - prompt_len
    max_tokens = req.max_tokens if req.max_tokens is not None else room
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


def prepare_completion(req: CompletionRequest, tokenizer, max_model_len: int,
                       vocab_size: int) -> PreparedRequest:
    prompt_ids = []
    for p in req.prompts():
        ids = list(tokenizer.encode(p, add_special_tokens=True)) if isinstance(p, str) else list(p)
        _check_ids(ids, vocab_size)
        prompt_ids.append(ids)
    params = [_sampling(req, len(ids), max_model_len, req.logprobs, j)
              for ids in prompt_ids for j in range(req.n)]
    return PreparedRequest("completion", prompt_ids, params, req.n, req.return_token_ids, req.logprobs)


def prepare_chat(req: ChatCompletionRequest, tokenizer, max_model_len: int,
                 vocab_size: int) -> PreparedRequest:
    try:
        text = tokenizer.apply_chat_template(req.message_dicts(), tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # template errors are the caller's input
        raise OpenAIError(f"could not apply the chat template: {exc}", param="messages") from None
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    _check_ids(ids, vocab_size)
    lp = (req.top_logprobs or 0) if req.logprobs else None
    params = [_sampling(req, len(ids), max_model_len, lp, j) for j in range(req.n)]
    return PreparedRequest("chat", [ids], params, req.n, req.return_token_ids, lp)


def usage(prepared: PreparedRequest, outputs: list[RequestOutput]) -> dict[str, Any]:
    prompt_tokens = sum(len(ids) for ids in prepared.prompt_ids)
    completion = sum(len(o.token_ids) for o in outputs)
    cached = sum(o.cached_tokens for i, o in enumerate(outputs) if i % prepared.n == 0)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def completion_logprobs(lps: list[TokenLogprob], tokenizer, text_offset: int = 0) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object; ``text_offset`` starts the offsets
    (a stream chunk passes the length of the text sent before it)."""
    tokens = [tokenizer.decode([lp.token_id]) for lp in lps]
    offsets, pos = [], text_offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{tokenizer.decode([t]): v for t, v in lp.top} for lp in lps],
            "text_offset": offsets}


def chat_logprobs(lps: list[TokenLogprob], tokenizer) -> dict[str, Any]:
    def entry(tid: int, value: float) -> dict[str, Any]:
        tok = tokenizer.decode([tid])
        return {"token": tok, "logprob": value, "bytes": list(tok.encode("utf-8"))}

    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]}


def completion_body(prepared: PreparedRequest, outputs: list[RequestOutput], model: str,
                    tokenizer, request_id: str | None = None) -> dict[str, Any]:
    choices = []
    for i, out in enumerate(outputs):
        choice: dict[str, Any] = {"index": i, "text": out.text, "finish_reason": out.finish_reason,
                                  "stop_reason": out.stop_reason, "logprobs": None}
        if prepared.logprobs is not None and out.logprobs is not None:
            choice["logprobs"] = completion_logprobs(out.logprobs, tokenizer)
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
              tokenizer, request_id: str | None = None) -> dict[str, Any]:
    choices = []
    for i, out in enumerate(outputs):
        choice: dict[str, Any] = {"index": i, "message": {"role": "assistant", "content": out.text},
                                  "finish_reason": out.finish_reason, "logprobs": None}
        if prepared.logprobs is not None and out.logprobs is not None:
            choice["logprobs"] = chat_logprobs(out.logprobs, tokenizer)
        if prepared.return_token_ids:
            choice["token_ids"] = out.token_ids
        choices.append(choice)
    body = {"id": request_id or f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": model, "choices": choices,
            "usage": usage(prepared, outputs)}
    if prepared.return_token_ids:
        body["prompt_token_ids"] = prepared.prompt_ids[0]
    return body
