"""The FastAPI app: routes, optional bearer API key, OpenAI error objects (no Ray).

Routes: ``GET /v1/models`` and ``/v1/models/{id}``, ``POST /v1/completions``,
``POST /v1/chat/completions``, ``POST /tokenize`` and ``/detokenize``, ``GET
/tokenizer_info``, ``GET /version``, ``GET /metrics`` (the metrics actor's Prometheus
text), ``GET /health`` and ``GET|POST /ping`` (never need the key), ``GET|POST
/flush_cache``, ``GET /debug/replicas`` (per-replica pool counts and stats), ``GET
/openapi.json`` (``openapi_schema``). Every
error -- ours, an unknown route, a wrong method, a bug -- is
``{"error": {"message", "type", "param", "code"}}`` with its status; every 503 also
carries ``Retry-After``. The Ray ingress serves this same app (``cluster/api/ingress.py``).

Request bodies: ``application/json`` only (else 415, as vLLM), at most
``ServerSettings.max_body_bytes`` (else 413, from ``content-length`` before reading and
counted while reading, so a chunked body cannot get past it either).
"""

from __future__ import annotations

import hmac
import json
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cluster.api.errors import OpenAIError
from cluster.api.openai_server import OpenAIServer, StartedResponse
from cluster.api.openapi_schema import OPEN_PATHS, install_openapi, operation

logger = logging.getLogger(__name__)
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
RETRY_AFTER_S = 1
GENERATE_ERRORS = (400, 401, 404, 413, 415, 503)
READ_ERRORS = (401, 503)
TOKENIZE_ERRORS = (400, 401, 404, 413, 415, 503)


def error_response(err: OpenAIError, headers: dict[str, str] | None = None) -> Response:
    """The error object with its status; a 503 always tells the client when to retry. ASCII
    JSON: a message quoting the client's text can hold no character that fails to encode."""
    headers = dict(headers or {})
    if err.status == 503:
        headers.setdefault("retry-after", str(RETRY_AFTER_S))
    return Response(json.dumps(err.body()), status_code=err.status, headers=headers, media_type="application/json")


def route_path(scope: Scope) -> str:
    """The path below the app's mount point (Serve mounts apps under a route prefix)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


class AuthMiddleware:
    """Pure ASGI (no per-chunk overhead on streams): the bearer key check on every path
    but ``OPEN_PATHS``, and ``x-request-id`` echoed back when the client sent one (unless
    ``echo_request_id`` is off: Serve's proxy echoes it itself). The refusal never
    repeats what the client sent in ``Authorization``."""

    def __init__(self, app: ASGIApp, api_key: str | None, echo_request_id: bool = True) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.echo_request_id = echo_request_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        rid = headers.get(b"x-request-id") if self.echo_request_id else None
        if self.api_key is not None and route_path(scope) not in OPEN_PATHS and not self._ok(headers):
            err = OpenAIError(
                "Incorrect or missing API key: send 'Authorization: Bearer <key>'", status=401, code="invalid_api_key"
            )
            extra = {"www-authenticate": "Bearer"}
            if rid:
                extra["x-request-id"] = rid.decode("latin-1")
            await error_response(err, extra)(scope, receive, send)
            return
        if rid is None:
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid)]}
            await send(message)

        await self.app(scope, receive, send_with_id)

    def _ok(self, headers: dict[bytes, bytes]) -> bool:
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        return (
            scheme.lower() == b"bearer"
            and self.api_key is not None
            and hmac.compare_digest(token.strip(), self.api_key)
        )


async def read_json_body(request: Request, limit: int) -> bytes:
    """The raw body of a JSON request: 415 unless ``application/json``, 413 past ``limit``."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise OpenAIError(
            f"Content-Type must be application/json, got {media_type or 'none'!r}"[:200],
            status=415,
            code="unsupported_media_type",
        )
    declared = request.headers.get("content-length")
    if declared is not None and not declared.isdigit():
        raise OpenAIError(f"invalid Content-Length {declared[:40]!r}")
    if declared is not None and int(declared) > limit:
        raise _too_large(limit)  # refused before reading a byte of it
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(limit)
    return bytes(body)


def _too_large(limit: int) -> OpenAIError:
    return OpenAIError(f"request body is larger than the limit of {limit} bytes", status=413, code="request_too_large")


def make_api(server: OpenAIServer, echo_request_id: bool = True) -> FastAPI:
    """The app over ``server``; pass ``echo_request_id=False`` behind a proxy that
    already echoes ``x-request-id`` (Ray Serve's), or responses carry it twice."""
    app = FastAPI(title="hybridserve", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.server = server
    _install_errors(app)
    install_openapi(app)
    app.add_middleware(AuthMiddleware, api_key=server.settings.api_key, echo_request_id=echo_request_id)
    _generate_routes(app, server, server.settings.max_body_bytes)
    _tokenizer_routes(app, server, server.settings.max_body_bytes)
    _service_routes(app, server)
    return app


def _generate_routes(app: FastAPI, server: OpenAIServer, limit: int) -> None:
    @app.get("/v1/models", openapi_extra=operation("ModelList", READ_ERRORS))
    async def models() -> JSONResponse:
        return JSONResponse(await server.models())

    @app.get("/v1/models/{model_id:path}", openapi_extra=operation("Model", READ_ERRORS + (404,)))
    async def model(model_id: str) -> JSONResponse:
        return JSONResponse(await server.model(model_id))

    @app.post(
        "/v1/completions", openapi_extra=operation("Completion", GENERATE_ERRORS, "CompletionRequest", stream=True)
    )
    async def completions(request: Request) -> Response:
        return await _respond(server, await server.start_completion(await read_json_body(request, limit)))

    @app.post(
        "/v1/chat/completions",
        openapi_extra=operation("ChatCompletion", GENERATE_ERRORS, "ChatCompletionRequest", stream=True),
    )
    async def chat_completions(request: Request) -> Response:
        return await _respond(server, await server.start_chat(await read_json_body(request, limit)))


def _tokenizer_routes(app: FastAPI, server: OpenAIServer, limit: int) -> None:
    @app.post("/tokenize", openapi_extra=operation("TokenizeResponse", TOKENIZE_ERRORS, "TokenizeRequest"))
    async def tokenize(request: Request) -> JSONResponse:
        return JSONResponse(await server.tokenize(await read_json_body(request, limit)))

    @app.post("/detokenize", openapi_extra=operation("DetokenizeResponse", TOKENIZE_ERRORS, "DetokenizeRequest"))
    async def detokenize(request: Request) -> JSONResponse:
        return JSONResponse(await server.detokenize(await read_json_body(request, limit)))

    @app.get("/tokenizer_info", openapi_extra=operation("TokenizerInfo", READ_ERRORS))
    async def tokenizer_info() -> JSONResponse:
        return JSONResponse(server.tokenizer_info())


def _service_routes(app: FastAPI, server: OpenAIServer) -> None:
    @app.get("/health", response_class=Response, openapi_extra=operation(None, (503,)))
    async def health() -> Response:
        await server.health()
        return Response(status_code=200)

    @app.get("/ping", response_class=Response, openapi_extra=operation(None, (503,)))
    async def ping_get() -> Response:  # SageMaker's health route
        return await health()

    @app.post("/ping", response_class=Response, openapi_extra=operation(None, (503,)))
    async def ping_post() -> Response:
        return await health()

    @app.get("/version", openapi_extra=operation("Version", READ_ERRORS))
    async def version() -> JSONResponse:
        return JSONResponse(server.version())

    @app.get("/metrics", response_class=Response, openapi_extra=operation(None, READ_ERRORS, text="plain"))
    async def metrics() -> Response:
        return Response(await server.metrics_text(), media_type=PROMETHEUS_TEXT)

    @app.get("/flush_cache", openapi_extra=operation("FlushResult", READ_ERRORS))
    async def flush_cache_get() -> JSONResponse:
        return JSONResponse(await server.flush_cache())

    @app.post("/flush_cache", openapi_extra=operation("FlushResult", READ_ERRORS))
    async def flush_cache_post() -> JSONResponse:
        return JSONResponse(await server.flush_cache())

    @app.get("/debug/replicas", openapi_extra=operation("ReplicaStats", READ_ERRORS))
    async def debug_replicas() -> JSONResponse:
        return JSONResponse(await server.replica_stats())


async def _respond(server: OpenAIServer, started: StartedResponse) -> Response:
    if started.stream:
        return StreamingResponse(
            server.events(started), media_type="text/event-stream", headers={"cache-control": "no-cache"}
        )
    return JSONResponse(await server.collect(started))


def _install_errors(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> Response:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(OpenAIError(str(exc.detail), status=exc.status_code, type=kind), dict(exc.headers or {}))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled error")
        return error_response(OpenAIError(f"internal error: {type(exc).__name__}", status=500, type="internal_error"))
