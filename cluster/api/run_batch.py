"""``hybridserve run-batch``: OpenAI batch JSONL in, JSONL out, no Ray, built on ``LLM``.

Each input line: ``{"custom_id", "method": "POST", "url": "/v1/completions" |
"/v1/chat/completions", "body": {...}}``. Every valid line runs in one shared engine
batch; a bad line gets an error object in its output line and the others still run.
Output lines keep input order.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Iterable

from cluster.api.chat_prompt import ChatSetup
from cluster.api.errors import OpenAIError
from cluster.api.openai_service import PreparedRequest, chat_body, completion_body, prepare_chat, prepare_completion
from cluster.api.prompt_logprobs import keep_best
from cluster.api.protocol import check_unicode, validate_chat, validate_completion
from workers.llm import LLM

_ROUTES = {
    "/v1/completions": (validate_completion, prepare_completion, completion_body),
    "/v1/chat/completions": (validate_chat, prepare_chat, chat_body),
}


@dataclass
class _Entry:
    custom_id: str | None
    url: str | None = None
    prepared: PreparedRequest | None = None
    error: OpenAIError | None = None


def _parse_line(line: str, llm: LLM, setup: ChatSetup) -> _Entry:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        return _Entry(None, error=OpenAIError(f"line is not valid JSON: {exc}"))
    if not isinstance(obj, dict):
        return _Entry(None, error=OpenAIError("line must be a JSON object"))
    entry = _Entry(obj.get("custom_id"), url=obj.get("url"))
    route = _ROUTES.get(entry.url or "")
    if route is None:
        entry.error = OpenAIError(f"url must be one of {sorted(_ROUTES)}, got {entry.url!r}", param="url")
        return entry
    validate, prepare, _ = route
    body = obj.get("body") or {}
    try:
        if not isinstance(body, dict):
            raise OpenAIError("body must be a JSON object", param="body")
        check_unicode(body)
        entry.prepared = prepare(validate(body), llm.tokenizer, llm.engine.max_model_len, llm.engine.vocab_size, setup)
    except OpenAIError as exc:
        entry.error = exc
    return entry


def _result_line(entry: _Entry, body: dict[str, Any] | None) -> dict[str, Any]:
    rid = f"batch_req_{uuid.uuid4().hex}"
    if entry.error is not None:
        return {
            "id": rid,
            "custom_id": entry.custom_id,
            "response": {"status_code": entry.error.status, "request_id": rid, "body": entry.error.body()},
            "error": {"code": entry.error.code or entry.error.type, "message": entry.error.message},
        }
    return {
        "id": rid,
        "custom_id": entry.custom_id,
        "response": {"status_code": 200, "request_id": rid, "body": body},
        "error": None,
    }


def run_batch(llm: LLM, lines: Iterable[str], model_name: str) -> list[dict[str, Any]]:
    s = llm.config.server
    setup = ChatSetup.for_tokenizer(
        llm.tokenizer,
        s.tool_call_parser,
        s.reasoning_parser,
        s.trust_request_chat_template,
        str(llm.config.model_dir()),
    )
    entries = [_parse_line(line, llm, setup) for line in lines if line.strip()]
    valid = [e for e in entries if e.prepared is not None]
    prompts = [ids for e in valid for ids in e.prepared.choice_prompts()]  # type: ignore[union-attr]
    params = [p for e in valid for p in e.prepared.params]  # type: ignore[union-attr]
    # best_of is already expanded into sequences: the LLM must not expand it again
    outputs = iter(llm.generate_ids(prompts, params, expand_best_of=False)) if prompts else iter(())
    results = []
    for entry in entries:
        if entry.prepared is None:
            results.append(_result_line(entry, None))
            continue
        prepared = entry.prepared
        mine = keep_best([next(outputs) for _ in prepared.params], prepared.n, prepared.kept().n)
        render = _ROUTES[entry.url or ""][2]
        results.append(_result_line(entry, render(prepared.kept(), mine, model_name, llm.tokenizer)))
    return results
