"""The FastAPI app: routes, optional bearer API key, OpenAI error objects (no Ray).

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /health`` (never needs the key), ``GET|POST /flush_cache``, ``GET /debug/replicas``
(per-replica pool counts and stats). Every error -- ours, an unknown route, a wrong
method, a bug -- is ``{"error": {"message", "type", "param", "code"}}`` with its status.
The Ray ingress serves this same app (``cluster/ingress.py``).
"""
from __future__ import annotations

import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cluster.openai_server import OpenAIServer, StartedResponse
from cluster.openai_service import OpenAIError

logger = logging.getLogger(__name__)
OPEN_PATHS = frozenset({"/health"})


def error_response(err: OpenAIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def route_path(scope: Scope) -> str:
    """The path below the app's mount point (Serve mounts apps under a route prefix)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class AuthMiddleware:
    """Pure ASGI (no per-chunk overhead on streams): the bearer key check on every path
    but ``OPEN_PATHS``, and ``x-request-id`` echoed back when the client sent one."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        rid = headers.get(b"x-request-id")
        if self.api_key is not None and route_path(scope) not in OPEN_PATHS and not self._ok(headers):
            err = OpenAIError("Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                              status=401, code="invalid_api_key")
            echo = {"x-request-id": rid.decode("latin-1")} if rid else None
            await error_response(err, echo)(scope, receive, send)
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
        return (scheme.lower() == b"bearer" and self.api_key is not None
                and hmac.compare_digest(token.strip(), self.api_key))


def make_api(server: OpenAIServer) -> FastAPI:
    app = FastAPI(title="hybridserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    _install_errors(app)
    app.add_middleware(AuthMiddleware, api_key=server.settings.api_key)

    @app.get("/health")
    async def health() -> Response:
        await server.health()
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(await server.models())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _respond(server, await server.start_completion(await request.body()))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _respond(server, await server.start_chat(await request.body()))

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> JSONResponse:
        return JSONResponse(await server.flush_cache())

    @app.get("/debug/replicas")
    async def debug_replicas() -> JSONResponse:
        return JSONResponse(await server.replica_stats())

    return app


async def _respond(server: OpenAIServer, started: StartedResponse) -> Response:
    if started.stream:
        return StreamingResponse(server.events(started), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})
    return JSONResponse(await server.collect(started))


def _install_errors(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(OpenAIError(str(exc.detail), status=exc.status_code, type=kind))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(OpenAIError(f"internal error: {type(exc).__name__}", status=500,
                                          type="internal_error"))
