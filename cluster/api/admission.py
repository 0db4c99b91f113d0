"""Admission control at the ingress: a bound on the HTTP requests one ingress replica serves.

``AdmissionLimit`` is a pure ASGI middleware wrapped around the FastAPI app (outermost,
so a refusal costs no parsing, tokenizing or routing). It counts the requests this
process is serving -- a streaming response counts until its last byte is sent or the
client leaves -- and answers every request beyond ``max_in_flight`` at once with 503,
``Retry-After`` and an OpenAI error object (``code: "server_overloaded"``).

Draining (graceful shutdown, ``begin_drain``): from then on every request -- ``/health``
included, so load balancers stop sending -- is answered 503 + ``Retry-After``
(``code: "server_shutting_down"``) while the admitted ones run to completion;
``in_flight`` reaching 0 tells the caller it may stop the server.

Invariants: ``in_flight`` is the number of admitted requests whose ASGI call has not
returned; it never exceeds ``max_in_flight``; paths in ``exempt_paths`` (``/health``)
are neither counted nor refused, so health checks work under overload. asyncio runs
the whole check-and-increment without a suspension point, so no lock is needed.

Why here and not only Serve's limits: beyond ``max_ongoing_requests`` plus
``max_queued_requests`` of the ingress deployment, the Serve proxy itself answers 503
with a plain-text body, not an OpenAI error object. Keeping ``max_in_flight`` below the
ingress deployment's ``max_ongoing_requests`` means requests reach this middleware
instead of queuing in the proxy (``cluster/app.py`` checks that).
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from cluster.api.errors import OpenAIError
from cluster.api.http_api import OPEN_PATHS, error_response, route_path


class AdmissionLimit:
    def __init__(
        self, app: ASGIApp, max_in_flight: int, retry_after_s: int = 1, exempt_paths: Iterable[str] = OPEN_PATHS
    ) -> None:
        if max_in_flight < 1 or retry_after_s < 0:
            raise ValueError(
                f"need max_in_flight >= 1 and retry_after_s >= 0, got "
                f"max_in_flight={max_in_flight}, retry_after_s={retry_after_s}"
            )
        self.app = app
        self.max_in_flight = max_in_flight
        self.retry_after_s = retry_after_s
        self.exempt_paths = frozenset(exempt_paths)
        self.in_flight = 0
        self.num_rejected = 0
        self.draining = False

    def begin_drain(self) -> int:
        """Refuse every new request from now on; returns the requests still in flight."""
        self.draining = True
        return self.in_flight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.draining:
            self.num_rejected += 1
            await self._refuse(scope, receive, send, draining=True)
            return
        if route_path(scope) in self.exempt_paths:
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.max_in_flight:
            self.num_rejected += 1
            await self._refuse(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, draining: bool = False) -> None:
        if draining:
            err = OpenAIError(
                "the server is shutting down; retry on another server",
                status=503,
                type="service_unavailable",
                code="server_shutting_down",
            )
        else:
            err = OpenAIError(
                f"the server is at its limit of {self.max_in_flight} concurrent requests; "
                f"retry after {self.retry_after_s} s",
                status=503,
                type="service_unavailable",
                code="server_overloaded",
            )
        await error_response(err, {"retry-after": str(self.retry_after_s)})(scope, receive, send)
