"""The OpenAPI document of the HTTP app: request bodies from ``protocol``, responses by hand.

The routes read raw bodies (validation and its error objects are ours, not FastAPI's), so
FastAPI cannot infer their schemas: each route gets its ``openapi_extra`` from
``operation`` here, and ``install_openapi`` adds the shared component schemas. The
response schemas are the contract the fuzz test (``tests/reliability/test_fuzz_openapi.py``)
checks every response against: every error is ``ErrorResponse``, every 503 carries
``Retry-After``.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from cluster.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from cluster.api.unsupported import CHAT, COMMON, COMPLETION, schema_properties

REF = "#/components/schemas/{model}"
OPEN_PATHS = frozenset({"/health", "/ping"})  # health checks: no API key, not admission-counted
REF_MODEL = {"$ref": REF.format(model="Model")}
_STR_OR_NULL = {"type": ["string", "null"]}
_INTS = {"type": "array", "items": {"type": "integer"}}

ERROR_STATUS_TEXT = {
    400: "invalid request",
    401: "missing or wrong API key",
    404: "unknown model",
    413: "request body too large",
    415: "body is not application/json",
    503: "engine unavailable or overloaded; retry after Retry-After seconds",
}

_ERROR = {
    "type": "object",
    "additionalProperties": False,
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "additionalProperties": False,
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string", "minLength": 1},
                "type": {"type": "string"},
                "param": _STR_OR_NULL,
                "code": _STR_OR_NULL,
            },
        }
    },
}

_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        "prompt_tokens": {"type": "integer", "minimum": 0},
        "completion_tokens": {"type": "integer", "minimum": 0},
        "total_tokens": {"type": "integer", "minimum": 0},
        "prompt_tokens_details": {
            "type": "object",
            "required": ["cached_tokens"],
            "properties": {"cached_tokens": {"type": "integer"}},
        },
    },
}


def _envelope(obj: str, choice: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": obj},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "minItems": 1, "items": choice},
            "usage": {"$ref": REF.format(model="Usage")},
            "prompt_token_ids": {"type": "array"},
        },
    }


# one server-sent event (as OpenAPI < 3.2 reads an event stream's schema): a JSON chunk
# or error object, or the final [DONE]
_SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "event": {"const": "message"},
        "data": {"anyOf": [{"const": "[DONE]"}, {"type": "string", "pattern": "^\\{.*\\}$"}]},
    },
}
_FINISH = {"type": ["string", "null"], "enum": ["stop", "length", "abort", "tool_calls", None]}
_TOOL_CALL = {
    "type": "object",
    "required": ["id", "type", "function"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name", "arguments"],
            "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
        },
    },
}
_COMPLETION = _envelope(
    "text_completion",
    {
        "type": "object",
        "required": ["index", "text", "finish_reason", "logprobs"],
        "properties": {
            "index": {"type": "integer", "minimum": 0},
            "text": {"type": "string"},
            "finish_reason": _FINISH,
            "stop_reason": {"type": ["string", "integer", "null"]},
            "logprobs": {"type": ["object", "null"]},
            "token_ids": _INTS,
            "prompt_token_ids": _INTS,
        },
    },
)
_CHAT = _envelope(
    "chat.completion",
    {
        "type": "object",
        "required": ["index", "message", "finish_reason", "logprobs"],
        "properties": {
            "index": {"type": "integer", "minimum": 0},
            "finish_reason": _FINISH,
            "message": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {
                    "role": {"const": "assistant"},
                    "content": _STR_OR_NULL,
                    "reasoning_content": _STR_OR_NULL,
                    "tool_calls": {"type": "array", "items": _TOOL_CALL},
                },
            },
            "logprobs": {"type": ["object", "null"]},
            "token_ids": _INTS,
        },
    },
)
_MODEL = {
    "type": "object",
    "required": ["id", "object", "created", "max_model_len"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "model"},
        "created": {"type": "integer", "minimum": 1},
        "root": {"type": "string"},
        "max_model_len": {"type": "integer", "minimum": 1},
    },
}
_MODELS = {
    "type": "object",
    "required": ["object", "data"],
    "properties": {"object": {"const": "list"}, "data": {"type": "array", "minItems": 1, "items": REF_MODEL}},
}
_TOKENIZED = {
    "type": "object",
    "required": ["count", "max_model_len", "tokens"],
    "properties": {
        "count": {"type": "integer", "minimum": 0},
        "max_model_len": {"type": "integer", "minimum": 1},
        "tokens": _INTS,
        "token_strs": {"type": ["array", "null"], "items": {"type": "string"}},
    },
}
_DETOKENIZED = {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}
_TOKENIZER_INFO = {
    "type": "object",
    "required": ["tokenizer_class"],
    "properties": {"tokenizer_class": {"type": "string"}, "chat_template": _STR_OR_NULL},
}
_VERSION = {"type": "object", "required": ["version"], "properties": {"version": {"type": "string"}}}
_FLUSHED = {
    "type": "object",
    "required": ["flushed", "replicas"],
    "properties": {"flushed": {"type": "boolean"}, "replicas": {"type": "array"}},
}
_REPLICAS = {
    "type": "object",
    "required": ["replicas"],
    "properties": {"replicas": {"type": "array", "items": {"type": "object"}}},
}


_REFUSED = {"CompletionRequest": {**COMMON, **COMPLETION}, "ChatCompletionRequest": {**COMMON, **CHAT}}


def _model_schemas() -> dict[str, Any]:
    """The request models' JSON schemas, their nested models hoisted into components; the
    fields ``unsupported`` refuses are described with the neutral values they accept."""
    out: dict[str, Any] = {}
    for model in (
        CompletionRequest,
        ChatCompletionRequest,
        TokenizeCompletionRequest,
        TokenizeChatRequest,
        DetokenizeRequest,
    ):
        schema = model.model_json_schema(ref_template=REF)
        out.update(schema.pop("$defs", {}))
        for name, prop in schema_properties(_REFUSED.get(model.__name__, {})).items():
            schema["properties"].setdefault(name, prop)
        out[model.__name__] = schema
    out["TokenizeRequest"] = {"anyOf": [_ref("TokenizeChatRequest"), _ref("TokenizeCompletionRequest")]}
    return out


def component_schemas() -> dict[str, Any]:
    return {
        **_model_schemas(),
        "ErrorResponse": _ERROR,
        "Usage": _USAGE,
        "Completion": _COMPLETION,
        "ChatCompletion": _CHAT,
        "StreamEvent": _SSE_EVENT,
        "Model": _MODEL,
        "ModelList": _MODELS,
        "FlushResult": _FLUSHED,
        "ReplicaStats": _REPLICAS,
        "TokenizeResponse": _TOKENIZED,
        "DetokenizeResponse": _DETOKENIZED,
        "TokenizerInfo": _TOKENIZER_INFO,
        "Version": _VERSION,
    }


def _ref(name: str) -> dict[str, str]:
    return {"$ref": REF.format(model=name)}


def _error(status: int) -> dict[str, Any]:
    resp: dict[str, Any] = {
        "description": ERROR_STATUS_TEXT[status],
        "content": {"application/json": {"schema": _ref("ErrorResponse")}},
    }
    if status == 503:
        resp["headers"] = {
            "Retry-After": {
                "required": True,
                "schema": {"type": "string"},
                "description": "seconds to wait before retrying",
            }
        }
    return resp


_EXAMPLES = {
    "CompletionRequest": {"prompt": "def fib(n):", "max_tokens": 8, "temperature": 0},
    "ChatCompletionRequest": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
}


def operation(
    ok: str | None, errors: tuple[int, ...], request: str | None = None, stream: bool = False, text: str | None = None
) -> dict[str, Any]:
    """``openapi_extra`` for one route: 200 with schema ``ok`` (None: no JSON body;
    ``stream``: also ``text/event-stream``; ``text``: a ``text/<text>`` body), the error
    statuses, and the JSON request body ``request`` (with a plain and a streaming example,
    when it has examples)."""
    content: dict[str, Any] = {"application/json": {"schema": _ref(ok)}} if ok else {}
    if stream:
        content["text/event-stream"] = {"schema": _ref("StreamEvent")}
    if text:
        content[f"text/{text}"] = {"schema": {"type": "string"}}
    ok_resp: dict[str, Any] = {"description": "success"}
    if content:
        ok_resp["content"] = content
    extra: dict[str, Any] = {"responses": {"200": ok_resp, **{str(s): _error(s) for s in errors}}}
    if request is not None:
        media: dict[str, Any] = {"schema": _ref(request)}
        if request in _EXAMPLES:
            media["examples"] = {
                "plain": {"value": _EXAMPLES[request]},
                "stream": {"value": {**_EXAMPLES[request], "stream": True}},
            }
        extra["requestBody"] = {"required": True, "content": {"application/json": media}}
    return extra


def install_openapi(app: FastAPI) -> None:
    """Serve ``app.openapi()`` with the component schemas and the bearer security scheme."""

    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = doc.setdefault("components", {})
            components.setdefault("schemas", {}).update(component_schemas())
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            for path, item in doc.get("paths", {}).items():
                for op in item.values():
                    op.pop("security", None)
                    if path not in OPEN_PATHS:
                        op["security"] = [{"bearer": []}]
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = build  # type: ignore[method-assign]
