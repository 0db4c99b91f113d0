"""A replica stream that survives its replica: ``ResumableStream`` (the ingress side).

It is a ``GenerateStream`` over one ``GenerateRequest``. When the replica stream raises
(the replica died, its engine loop failed) or ends before every choice finished, the
unfinished choices are re-issued through the same ``EngineClient`` (the router picks a
healthy replica) with the tokens already sent (``resume.StreamBook``); the consumer sees
one stream of chunks. A replica that fails before accepting is retried the same way when
``ResumeSettings.retry_open`` says the error means it died.

Nothing is given up silently: a stream that cannot be resumed -- ``max_resumes`` used,
no replica accepted within ``timeout_s``, the new replica refused the resumed request --
raises an ``OpenAIError`` the server renders as an error event (or a 503 before a
response started). Outcomes are counted in ``StreamCounters`` (pushed to the metrics actor
by the Ray ingress): ``hybridserve_stream_migrations_total``,
``hybridserve_stream_retries_total``, ``hybridserve_stream_resume_failures_total{reason}``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from cluster.api.errors import OpenAIError
from cluster.api.resume import StreamBook
from cluster.observability.metrics_registry import STREAM_MIGRATIONS as MIGRATIONS
from cluster.observability.metrics_registry import STREAM_RESUME_FAILURES as RESUME_FAILURES
from cluster.observability.metrics_registry import STREAM_RETRIES as RETRIES
from cluster.serving.engine_client import EngineClient, GenerateStream
from cluster.serving.messages import Accepted, GenerateChunk, GenerateError, GenerateRequest
from configs.serving import IngressConfig

logger = logging.getLogger(__name__)
_INGRESS = IngressConfig()


def _never(exc: BaseException) -> bool:
    return False


@dataclass(frozen=True)
class ResumeSettings:
    """A view of ``ingress.max_stream_resumes`` and ``ingress.resume_timeout_s``;
    ``retry_open``: whether an error before ``Accepted`` means the chosen replica died
    (the Ray ingress: Ray's actor errors; never elsewhere: an overloaded or absent
    deployment still answers 503 at once)."""

    max_resumes: int = _INGRESS.max_stream_resumes
    timeout_s: float = _INGRESS.resume_timeout_s
    retry_open: Callable[[BaseException], bool] = _never
    backoff_s: float = 0.1  # the first wait between two attempts; doubles up to 1 s

    @classmethod
    def from_config(
        cls, ingress: IngressConfig, retry_open: Callable[[BaseException], bool] = _never
    ) -> ResumeSettings:
        return cls(ingress.max_stream_resumes, ingress.resume_timeout_s, retry_open)


class StreamCounters:
    """The ingress's resume counters: cumulative ``totals`` keyed (name, label or None);
    each increment is also handed to ``push`` (the metrics actor, as a delta)."""

    def __init__(self, push: Callable[[str, str | None], None] | None = None) -> None:
        self.totals: dict[tuple[str, str | None], int] = {}
        self._push = push

    def inc(self, name: str, label: str | None = None) -> None:
        self.totals[(name, label)] = self.totals.get((name, label), 0) + 1
        if self._push is not None:
            try:
                self._push(name, label)
            except Exception:  # noqa: BLE001 - a lost count never fails a stream
                logger.debug("pushing a stream counter failed", exc_info=True)


class ResumableStream:
    def __init__(
        self, client: EngineClient, book: StreamBook, settings: ResumeSettings, counters: StreamCounters
    ) -> None:
        self.client, self.book, self.settings, self.counters = client, book, settings, counters
        self._stream: GenerateStream | None = None
        self._open: set[int] = set()  # current-stream choices the replica has not finished

    @classmethod
    async def open(
        cls, client: EngineClient, req: GenerateRequest, settings: ResumeSettings, counters: StreamCounters
    ) -> ResumableStream:
        """The accepted stream (``GenerateError`` -> ``OpenAIError``; a replica that died
        before accepting is retried while ``settings.retry_open`` says so)."""
        self = cls(client, StreamBook(req), settings, counters)
        if await self._accept(req, settings.retry_open, time.monotonic() + settings.timeout_s):
            counters.inc(RETRIES)
        return self

    def __aiter__(self) -> ResumableStream:
        return self

    async def __anext__(self) -> list[GenerateChunk]:
        while True:
            if self.book.finished and not self._open:
                await self._drain()
                raise StopAsyncIteration
            if self.book.finished:  # cut here at a stop string: the replica still runs it
                self.cancel()
                raise StopAsyncIteration
            assert self._stream is not None
            try:
                item = await self._stream.__anext__()
                if not isinstance(item, list):
                    raise RuntimeError(f"unexpected replica stream item {item!r}")
            except StopAsyncIteration:
                await self._resume(RuntimeError("the replica stream ended before every choice finished"))
                continue
            except Exception as exc:  # noqa: BLE001 - the replica failed: continue elsewhere
                await self._resume(exc)
                continue
            self._open -= {c.index for c in item if c.finished}
            chunks = self.book.absorb(item)
            if chunks:
                return chunks

    def cancel(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            try:
                stream.cancel()
            except Exception:  # noqa: BLE001 - best effort; the replica also aborts on close
                logger.debug("cancel failed", exc_info=True)

    async def _drain(self) -> None:
        """Read the finished replica stream to its end (it ends right after its last chunk)."""
        if self._stream is not None:
            try:
                async for _ in self._stream:
                    pass
            except Exception:  # noqa: BLE001 - every choice is complete; the end is a formality
                logger.debug("replica stream failed after its last chunk", exc_info=True)
            self._stream = None

    async def _resume(self, exc: Exception) -> None:
        self.cancel()
        rid = self.book.request.request_id
        if self.book.num_resumes >= self.settings.max_resumes:
            raise self._failure("exhausted", f"its replica failed ({_name(exc)}) after {self.book.num_resumes} resumes")
        plan = self.book.plan()
        logger.warning(
            "stream %s: replica failed (%s); resuming as %s (%s)", rid, _name(exc), plan.request.request_id, plan.kind
        )
        deadline = time.monotonic() + self.settings.timeout_s
        await self._accept(plan.request, lambda e: True, deadline)
        self.counters.inc(MIGRATIONS if plan.kind == "migration" else RETRIES)

    async def _accept(self, req: GenerateRequest, retry: Callable[[BaseException], bool], deadline: float) -> int:
        """Open ``req``'s stream and wait for ``Accepted``, trying again (with backoff) on
        errors ``retry`` allows until ``deadline``; returns the failed attempts."""
        wait, failed = self.settings.backoff_s, 0
        while True:
            stream = self.client.generate(req)
            try:
                first = await stream.__anext__()
            except Exception as exc:  # noqa: BLE001 - sorted below
                _cancel(stream)
                if not retry(exc):
                    raise
                if time.monotonic() + wait > deadline:
                    raise self._failure(
                        "timeout", f"no replica accepted it within {self.settings.timeout_s:g} s (last: {_name(exc)})"
                    ) from None
                failed += 1
                await asyncio.sleep(wait)
                wait = min(2 * wait, 1.0)
                continue
            except BaseException:
                _cancel(stream)
                raise
            if isinstance(first, Accepted):
                self._stream, self._open = stream, set(range(req.num_choices))
                return failed
            _cancel(stream)
            if isinstance(first, GenerateError):
                if req is not self.book.request:  # a resumed input refused: say so, in-band
                    raise self._failure("refused", f"the replica refused the resumed request: {first.message}", 500)
                raise OpenAIError(first.message, param=first.param)
            raise RuntimeError(f"unexpected first replica message {first!r}")

    def _failure(self, reason: str, detail: str, status: int = 503) -> OpenAIError:
        self.counters.inc(RESUME_FAILURES, reason)
        code = "engine_unavailable" if status == 503 else "stream_not_resumable"
        kind = "service_unavailable" if status == 503 else "server_error"
        return OpenAIError(f"the stream could not be resumed: {detail}", status=status, type=kind, code=code)


def _name(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None) or exc
    first = (str(cause).strip().splitlines() or [""])[0][:120]
    return f"{type(cause).__name__}: {first}" if first else type(cause).__name__


def _cancel(stream: GenerateStream) -> None:
    try:
        stream.cancel()
    except Exception:  # noqa: BLE001 - best effort
        logger.debug("cancel failed", exc_info=True)
