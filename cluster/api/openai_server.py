"""The OpenAI endpoints' logic over an ``EngineClient`` (no Ray, no FastAPI routing).

Every way a request can be refused is found BEFORE a response starts: parsing and
validation (``protocol``), the model name, tokenization and context length
(``openai_service.prepare_*``), then the replica's own acceptance (the first item of each
replica stream is ``Accepted`` or ``GenerateError``). Those raise ``OpenAIError`` (4xx);
an unreachable replica is a 503. Once a stream has started, a failure becomes an error
event followed by ``[DONE]``.

Leaving early -- the client disconnects, the handler is cancelled -- cancels every
replica stream of the request, which aborts its choices in the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cluster.api.chat_prompt import ChatSetup
from cluster.api.errors import OpenAIError
from cluster.api.openai_service import PreparedRequest, chat_body, completion_body, prepare_chat, prepare_completion
from cluster.api.prompt_logprobs import keep_best
from cluster.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    check_unicode,
    validate_chat,
    validate_completion,
    validate_detokenize,
    validate_tokenize,
)
from cluster.api.resumable import ResumableStream, ResumeSettings, StreamCounters
from cluster.api.streaming import ResponseState, SSERenderer
from cluster.api.tokenization import detokenize_body, tokenize_body, tokenizer_info_body, version_body
from cluster.serving.engine_client import EngineClient, GenerateStream
from cluster.serving.messages import GenerateChunk, GenerateRequest, ModelInfo
from configs.schema import HybridServeConfig, ServerConfig
from configs.serving import IngressConfig

logger = logging.getLogger(__name__)


_SERVER, _INGRESS = ServerConfig(), IngressConfig()


@dataclass(frozen=True)
class ServerSettings:
    """What the endpoints read: a view of the config's ``server`` section and
    ``ingress.max_body_bytes`` (``from_config``; ``configs/schema.py`` validates them)."""

    model_name: str
    model_root: str  # the checkpoint the name stands for (``root``)
    api_key: str | None = _SERVER.api_key
    max_body_bytes: int = _INGRESS.max_body_bytes
    tool_call_parser: str = _SERVER.tool_call_parser
    reasoning_parser: str = _SERVER.reasoning_parser
    trust_request_chat_template: bool = _SERVER.trust_request_chat_template
    created: int = field(default_factory=lambda: int(time.time()))  # /v1/models ``created``

    @classmethod
    def from_config(cls, config: HybridServeConfig, model_name: str | None = None) -> ServerSettings:
        """``model_name`` (in-process callers) replaces the config's served name. ``root`` is
        the checkpoint's absolute path, so a bench client on this machine can load the same
        tokenizer whatever its working directory."""
        s = config.server
        return cls(
            model_name or config.served_model_name(),
            str(config.model_dir().resolve()),
            s.api_key,
            config.ingress.max_body_bytes,
            s.tool_call_parser,
            s.reasoning_parser,
            s.trust_request_chat_template,
        )


@dataclass(frozen=True)
class StartedResponse:
    """A request every replica accepted: stream it (``events``) or ``collect`` it."""

    prepared: PreparedRequest
    request_id: str
    streams: list[GenerateStream]
    stream: bool
    include_usage: bool
    continuous_usage: bool = False


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(raw or b"")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise OpenAIError(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise OpenAIError(f"request body must be a JSON object, got {type(obj).__name__}")
    check_unicode(obj)
    return obj


class OpenAIServer:
    def __init__(
        self,
        client: EngineClient,
        tokenizer: Any,
        settings: ServerSettings,
        resume: ResumeSettings = ResumeSettings(),
        counters: StreamCounters | None = None,
    ) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.settings = settings
        self.resume = resume  # a failed replica's streams continue elsewhere (``resumable.py``)
        self.counters = counters if counters is not None else StreamCounters()
        self.chat_setup = ChatSetup.for_tokenizer(
            tokenizer,
            settings.tool_call_parser,
            settings.reasoning_parser,
            settings.trust_request_chat_template,
            settings.model_root,
        )
        self._info: ModelInfo | None = None

    async def model_info(self) -> ModelInfo:
        if self._info is None:
            try:
                self._info = await self.client.model_info()
            except Exception as exc:  # noqa: BLE001 - any replica failure is a 503 here
                raise _unavailable(exc) from None
        return self._info

    async def _model_card(self) -> dict[str, Any]:
        info = await self.model_info()
        return {
            "id": self.settings.model_name,
            "object": "model",
            "created": self.settings.created,
            "owned_by": "hybridserve",
            "root": self.settings.model_root,
            "parent": None,
            "max_model_len": info.max_model_len,
            "permission": [],
        }

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [await self._model_card()]}

    async def model(self, model_id: str) -> dict[str, Any]:
        """``GET /v1/models/{id}``: the card, or a 404 naming what is served."""
        self._check_model(model_id)
        return await self._model_card()

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.settings.model_name:
            raise OpenAIError(
                f"The model `{name}` does not exist; this server serves `{self.settings.model_name}`",
                status=404,
                param="model",
                code="model_not_found",
            )

    async def start_completion(self, raw: bytes) -> StartedResponse:
        return await self._start(validate_completion(parse_json(raw)), prepare_completion, "cmpl")

    async def start_chat(self, raw: bytes) -> StartedResponse:
        return await self._start(validate_chat(parse_json(raw)), prepare_chat, "chatcmpl")

    async def _start(
        self, req: CompletionRequest | ChatCompletionRequest, prepare: Callable[..., PreparedRequest], prefix: str
    ) -> StartedResponse:
        self._check_model(req.model)
        info = await self.model_info()
        prepared = prepare(req, self.tokenizer, info.max_model_len, info.vocab_size, self.chat_setup)
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        streams = await self._open_streams(prepared, request_id)
        options = req.stream_options
        return StartedResponse(
            prepared,
            request_id,
            streams,
            req.stream,
            bool(options and options.include_usage),
            bool(options and options.continuous_usage_stats),
        )

    async def tokenize(self, raw: bytes) -> dict[str, Any]:
        req = validate_tokenize(parse_json(raw))
        self._check_model(req.model)
        info = await self.model_info()
        return tokenize_body(req, self.tokenizer, self.chat_setup, info.max_model_len)

    async def detokenize(self, raw: bytes) -> dict[str, Any]:
        req = validate_detokenize(parse_json(raw))
        self._check_model(req.model)
        return detokenize_body(req, self.tokenizer, (await self.model_info()).vocab_size)

    def tokenizer_info(self) -> dict[str, Any]:
        return tokenizer_info_body(self.tokenizer, self.chat_setup)

    def version(self) -> dict[str, str]:
        return version_body()

    async def metrics_text(self) -> str:
        try:
            return await self.client.metrics_text()
        except Exception as exc:  # noqa: BLE001 - the metrics actor is unreachable
            raise _unavailable(exc) from None

    async def _open_streams(self, prepared: PreparedRequest, request_id: str) -> list[GenerateStream]:
        """Open one replica stream per prompt and wait for each to be accepted.

        One at a time on purpose: Serve gives every handle call made while serving one
        HTTP request the same internal request id, and its request router matches a
        routing decision to a pending call by that id, so concurrent sibling calls could
        be matched to each other's replica (or never). Awaiting ``Accepted`` means the
        call has been assigned; after that the streams run concurrently.
        """
        n = prepared.n
        streams: list[GenerateStream] = []
        try:
            for i, ids in enumerate(prepared.prompt_ids):
                text = prepared.prompt_texts[i] if i < len(prepared.prompt_texts) else ""
                req = GenerateRequest(f"{request_id}-{i}", ids, prepared.params[i * n : (i + 1) * n], text)
                streams.append(await ResumableStream.open(self.client, req, self.resume, self.counters))
        except BaseException as exc:
            _cancel_all(streams)
            if isinstance(exc, Exception) and not isinstance(exc, OpenAIError):
                raise _unavailable(exc) from None
            raise
        return streams

    async def collect(self, started: StartedResponse) -> dict[str, Any]:
        state = ResponseState(started.prepared)
        merged = merge_streams(started.streams)
        try:
            async for i, chunks in merged:
                state.absorb(i, chunks)
        except OpenAIError:  # a stream that could not be resumed
            raise
        except Exception as exc:  # noqa: BLE001 - a replica failed mid-request
            raise _unavailable(exc) from None
        finally:
            if not state.finished:
                _cancel_all(started.streams)
            await merged.aclose()
        render = chat_body if started.prepared.kind == "chat" else completion_body
        prepared = started.prepared
        outputs = keep_best(state.outputs(), prepared.n, prepared.kept().n)  # best_of
        return render(prepared.kept(), outputs, self.settings.model_name, self.tokenizer, started.request_id)

    async def events(self, started: StartedResponse) -> AsyncIterator[str]:
        """SSE events; closing this generator early cancels the replica streams."""
        state = ResponseState(started.prepared)
        renderer = SSERenderer(
            started.prepared,
            self.settings.model_name,
            started.request_id,
            self.tokenizer,
            started.include_usage,
            continuous_usage=started.continuous_usage,
        )
        merged = merge_streams(started.streams)
        try:
            for event in renderer.first_events(len(state.choices)):
                yield event
            try:
                async for i, chunks in merged:
                    for event in renderer.delta_events(state.absorb(i, chunks), state):
                        yield event
            except Exception as exc:  # noqa: BLE001 - headers are sent; report in-band
                logger.warning("stream %s failed: %r", started.request_id, exc)
                err = exc if isinstance(exc, OpenAIError) else _unavailable(exc)
                for event in renderer.error_events(err):
                    yield event
                return
            for event in renderer.final_events(state):
                yield event
        finally:
            if not state.finished:
                _cancel_all(started.streams)
            await merged.aclose()

    async def flush_cache(self) -> dict[str, Any]:
        try:
            results = await self.client.flush_cache()
        except Exception as exc:  # noqa: BLE001
            raise _unavailable(exc) from None
        return {"flushed": all(r.get("flushed") for r in results), "replicas": results}

    async def replica_stats(self) -> dict[str, Any]:
        try:
            return {"replicas": await self.client.replica_stats()}
        except Exception as exc:  # noqa: BLE001
            raise _unavailable(exc) from None

    async def health(self, timeout_s: float = 10.0) -> None:
        try:
            await asyncio.wait_for(self.client.health(), timeout_s)
        except Exception as exc:  # noqa: BLE001
            raise _unavailable(exc) from None


async def merge_streams(streams: Sequence[GenerateStream]) -> AsyncIterator[tuple[int, list[GenerateChunk]]]:
    """(prompt index, chunks) from every stream as they come; cancels all on early exit."""
    if len(streams) == 1:
        completed = False
        try:
            async for item in streams[0]:
                yield 0, _chunks(item)
            completed = True
        finally:
            if not completed:
                _cancel_all(streams)
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: GenerateStream) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item))
            queue.put_nowait((i, done))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, _chunks(item)
    finally:
        if remaining:
            for task in tasks:
                task.cancel()
            _cancel_all(streams)


def _chunks(item: object) -> list[GenerateChunk]:
    if not isinstance(item, list):
        raise RuntimeError(f"unexpected replica stream item {item!r}")
    return item


def _cancel_all(streams: Sequence[GenerateStream]) -> None:
    for stream in streams:
        try:
            stream.cancel()
        except Exception:  # noqa: BLE001 - best effort; the replica also times out
            logger.debug("cancel failed", exc_info=True)


def _unavailable(exc: BaseException) -> OpenAIError:
    """A 503 naming the root failure in one line (a Ray task error's ``str`` is a whole
    remote traceback: logged here, never sent to the client)."""
    logger.warning("engine call failed: %r", exc)
    cause = getattr(exc, "cause", None) or exc
    first = (str(cause).strip().splitlines() or [""])[0][:200]
    return OpenAIError(
        f"the engine is unavailable: {type(cause).__name__}: {first}",
        status=503,
        type="service_unavailable",
        code="engine_unavailable",
    )
