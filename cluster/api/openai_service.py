"""OpenAI semantics shared by run-batch and the HTTP ingress: requests in, bodies out.

``prepare_*`` turns a validated request into token ids and per-choice SamplingParams,
raising ``OpenAIError`` (a 4xx) for anything the engine would refuse, so errors surface
before any generation or stream starts. ``*_body`` renders finished outputs.
"""
from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

from pydantic import ValidationError

from cluster.api.prompt_logprobs import echo_logprobs, vllm_prompt_logprobs
from cluster.api.protocol import ChatCompletionRequest, CompletionRequest
from cluster.api.sampling_fields import ConstraintError
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
    n: int                                 # sequences run per prompt (best_of when given)
    return_token_ids: bool
    logprobs: int | None
    echo: bool = False                     # completions: the prompt (and its logprobs) first
    prompt_texts: tuple[str, ...] = ()     # per prompt, for echo
    prompt_logprobs: int | None = None     # vLLM's prompt_logprobs field, top-k per position
    keep: int | None = None                # best_of: the n choices returned per prompt

    def choice_prompts(self) -> list[list[int]]:
        return [ids for ids in self.prompt_ids for _ in range(self.n)]

    def kept(self) -> PreparedRequest:
        """What the body renders once the best ``keep`` of ``n`` sequences are chosen."""
        return self if self.keep is None else replace(self, n=self.keep, keep=None)


def _extras(req: CompletionRequest | ChatCompletionRequest, vocab_size: int) -> dict[str, Any]:
    """The SamplingParams of issue 15's fields (once per request: a schema compiles once)."""
    try:
        extras = req.sampling_kwargs()
    except ConstraintError as exc:
        raise OpenAIError(str(exc), param=exc.param) from None
    bad = [t for t in extras["logit_bias"] if t >= vocab_size]
    if bad:
        raise OpenAIError(f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})",
                          param="logit_bias")
    return extras


def _runs(req: CompletionRequest | ChatCompletionRequest) -> int:
    """Sequences per prompt: best_of (>= n) or n; best_of > n is not streamed (OpenAI)."""
    best_of = req.best_of or req.n
    if best_of < req.n:
        raise OpenAIError(f"best_of={best_of} must be >= n={req.n}", param="best_of")
    if best_of > req.n and req.stream:
        raise OpenAIError("best_of > n cannot be streamed", param="best_of")
    return best_of


def _sampling(req: CompletionRequest | ChatCompletionRequest, prompt_len: int, max_model_len: int,
              logprobs: int | None, choice: int, extras: dict[str, Any],
              prompt_logprobs: int | None = None) -> SamplingParams:
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
    best_of = req.best_of if (req.best_of or 1) > req.n else None     # ranked: cumulative logprobs
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=max(req.top_p, MIN_TOP_P),
                          top_k=req.top_k, seed=seed, stop=tuple(req.stop or ()),
                          stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
                          logprobs=logprobs, min_tokens=min(req.min_tokens, max_tokens),
                          prompt_logprobs=prompt_logprobs, best_of=best_of, **extras)


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
    if req.max_tokens == 0 and not (req.echo or req.prompt_logprobs is not None):
        raise OpenAIError("max_tokens: 0 generates nothing; it needs echo or prompt_logprobs", param="max_tokens")
    extras, runs = _extras(req, vocab_size), _runs(req)
    # echo with logprobs scores the prompt too, with as many alternatives
    scored = [k for k in (req.prompt_logprobs, req.logprobs if req.echo else None) if k is not None]
    k = max(scored) if scored else None
    params = [_sampling(req, len(ids), max_model_len, req.logprobs, j, extras, k)
              for ids in prompt_ids for j in range(runs)]
    texts = tuple(p if isinstance(p, str) else tokenizer.decode(ids) for p, ids in zip(req.prompts(), prompt_ids))
    return PreparedRequest("completion", prompt_ids, params, runs, req.return_token_ids, req.logprobs,
                           echo=req.echo, prompt_texts=texts, prompt_logprobs=req.prompt_logprobs,
                           keep=req.n if runs != req.n else None)


def prepare_chat(req: ChatCompletionRequest, tokenizer, max_model_len: int,
                 vocab_size: int) -> PreparedRequest:
    try:
        text = tokenizer.apply_chat_template(req.message_dicts(), tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # template errors are the caller's input
        raise OpenAIError(f"could not apply the chat template: {exc}", param="messages") from None
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    _check_ids(ids, vocab_size)
    lp = (req.top_logprobs or 0) if req.logprobs else None
    extras, runs = _extras(req, vocab_size), _runs(req)
    params = [_sampling(req, len(ids), max_model_len, lp, j, extras, req.prompt_logprobs) for j in range(runs)]
    return PreparedRequest("chat", [ids], params, runs, req.return_token_ids, lp,
                           prompt_logprobs=req.prompt_logprobs, keep=req.n if runs != req.n else None)


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
        if prepared.echo:
            echo_choice(choice, prepared, i // prepared.n, out, tokenizer)
        if prepared.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(out.prompt_logprobs or [], prepared.prompt_logprobs,
                                                             tokenizer)
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


def echo_choice(choice: dict[str, Any], prepared: PreparedRequest, prompt: int, out: RequestOutput,
                tokenizer) -> None:
    """Put the prompt in front of a completions choice's text and logprobs (``echo``)."""
    text = prepared.prompt_texts[prompt]
    choice["text"] = text + choice["text"]
    if prepared.logprobs is None:
        return
    head = echo_logprobs(prepared.prompt_ids[prompt], out.prompt_logprobs or [], prepared.logprobs, tokenizer)
    tail = choice["logprobs"] or completion_logprobs([], tokenizer)
    tail_offsets = [o + len(text) for o in tail["text_offset"]]
    choice["logprobs"] = {key: [*head[key], *(tail_offsets if key == "text_offset" else tail[key])]
                          for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


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
    if prepared.prompt_logprobs is not None and outputs:
        body["prompt_logprobs"] = vllm_prompt_logprobs(outputs[0].prompt_logprobs or [], prepared.prompt_logprobs,
                                                       tokenizer)
    if prepared.return_token_ids:
        body["prompt_token_ids"] = prepared.prompt_ids[0]
    return body
