"""Everything an ``EngineReplica`` does, as a plain class (no Ray, tested directly).

``ReplicaCore`` owns one engine behind an ``EngineLoop`` and speaks in ``messages``:
``generate`` streams ``Accepted`` | ``GenerateError`` then lists of ``GenerateChunk``;
closing the stream early (client gone, caller cancelled) aborts the unfinished choices,
which frees their KV pages and Mamba slots.

The engine is built by ``build_engine``: a plain ``Engine``, or for
``parallel.tensor_parallel_size > 1`` a ``TPEngine`` with Ray worker ranks (``cluster/serving/tp.py``),
which is an ``Engine``: this layer calls the engine's methods by name, typed.

With a ``fetcher`` (the cluster store's ``StoreClient``), every prompt that can read the
cache (``wants_cache``) is first offered to it: it may place a checkpoint fetched from the
store in the engine's host tier before the request is queued (``cluster/store/client.py``);
a failing fetcher never fails a request. The engine keeps its cache events for the router
index (``_publishing``).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from cluster.pd.handoff import HandoffSource, HandoffStash, export_handoff, import_handoff
from cluster.serving.engine_loop import EngineLoop
from cluster.serving.messages import (
    Accepted,
    GenerateChunk,
    GenerateError,
    GenerateRequest,
    Handoff,
    ModelInfo,
    ReplicaStats,
)
from configs.schema import HybridServeConfig
from configs.serving import ReplicaConfig
from workers.output_processor import HANDOFF
from workers.outputs import OutputDelta

if TYPE_CHECKING:  # the engine's module loads torch; the type is enough here
    from workers.engine import Engine
    from workers.tiers.payload import CheckpointPayload

StreamItem = Accepted | GenerateError | list[GenerateChunk] | Handoff
logger = logging.getLogger(__name__)


class Fetcher(Protocol):
    async def prefetch(self, loop: EngineLoop, token_ids: list[int]) -> str: ...


def wants_cache(req: GenerateRequest) -> bool:
    """Whether a cached prefix can serve any choice of ``req``. A choice asking for
    ``prompt_logprobs`` needs the logits of every prompt position, so it reads no cache
    (``Request.max_cached_prefix``); a store fetch for it would move bytes nobody reads."""
    return any(p.prompt_logprobs is None for p in req.params)


def check_supported(config: HybridServeConfig) -> None:
    """Raise ValueError for a config no replica can run (checked at build and at startup).

    ``tensor_parallel_size`` must divide every head count and intermediate size of the
    model (checked from its config.json when this process can read it).
    """
    tp = config.parallel.tensor_parallel_size
    model_dir = config.model_dir()
    if tp > 1 and (model_dir / "config.json").is_file():
        from workers.loader import load_config
        from workers.tp import validate_tp

        validate_tp(load_config(model_dir), tp)


def build_engine(config: HybridServeConfig) -> Engine:
    """The engine of one replica (one TP group). Raises ValueError for what cannot run.

    For ``tensor_parallel_size > 1``: a ``TPEngine`` (rank 0, here) whose other ranks are
    Ray actors in the replica's placement group (``cluster/serving/tp.py``).
    """
    check_supported(config)
    if config.parallel.tensor_parallel_size > 1:
        from cluster.serving.tp import build_tp_engine

        return build_tp_engine(config)
    from workers.engine import Engine

    return Engine(config)


def _publishing(engine: Engine) -> Engine:
    """The engine, keeping the cache events the replica sends the router index."""
    engine.record_cache_events()
    return engine


@dataclass(frozen=True)
class StreamPacing:
    """How soon a stream may send its next item (after its first; ``gap``).

    ``interval_s``: the least time between two items of one stream (Ray Serve LLM's stream
    batching): the tokens of the engine steps in between travel together; 0 sends every
    step. ``items_per_s`` (0: no budget): the most items per second the replica sends, all
    its streams together -- with ``num_streams`` open, each stream's gap grows to
    ``num_streams / items_per_s`` -- but never past ``max_interval_s``. An item costs the
    Ray and HTTP hops about the same whatever it carries (BENCHMARKS.md, the HTTP path), so
    the budget keeps that cost per token falling as the batch grows. The first token and
    the last item are never held back: TTFT, E2E and TPOT do not move, only ITL does.
    """

    interval_s: float = 0.0
    items_per_s: float = 0.0
    max_interval_s: float = 0.25

    def __post_init__(self) -> None:
        for name in ("interval_s", "items_per_s", "max_interval_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"stream pacing {name} must be >= 0, got {getattr(self, name)}")

    @classmethod
    def from_config(cls, replica: ReplicaConfig) -> StreamPacing:
        """A deployed replica's pacing: the config's ``replica.*stream*`` settings."""
        return cls(replica.stream_interval_s, replica.stream_items_per_s, replica.max_stream_interval_s)

    def gap(self, num_streams: int) -> float:
        if self.items_per_s <= 0:
            return self.interval_s
        return max(self.interval_s, min(num_streams / self.items_per_s, self.max_interval_s))


class ReplicaCore:
    """``pacing``: when each stream sends its next item (``StreamPacing``; a float is its
    ``interval_s`` alone)."""

    def __init__(
        self,
        loop: EngineLoop,
        config: HybridServeConfig,
        pacing: StreamPacing | float = 0.0,
        fetcher: Fetcher | None = None,
        pd: PDSide | None = None,
    ) -> None:
        self.loop = loop
        self.config = config
        self.pacing = pacing if isinstance(pacing, StreamPacing) else StreamPacing(float(pacing))
        self.fetcher = fetcher
        self.pd = pd or PDSide(config.pd.transfer_timeout_s)
        if self.pd.stash is None:
            self.pd = replace(self.pd, stash=HandoffStash(config.pd.handoff_ttl_s))

    @classmethod
    async def create(
        cls,
        config: HybridServeConfig,
        pacing: StreamPacing | float = 0.0,
        fetcher: Fetcher | None = None,
        pd: PDSide | None = None,
    ) -> ReplicaCore:
        # refused before the build
        pacing = pacing if isinstance(pacing, StreamPacing) else StreamPacing(float(pacing))
        loop = await EngineLoop.create(lambda: _publishing(build_engine(config)))
        return cls(loop, config, pacing, fetcher, pd)

    def model_info(self) -> ModelInfo:
        engine = self.loop.engine
        return ModelInfo(int(engine.max_model_len), int(engine.vocab_size), str(self.config.model_dir()))

    async def generate(self, req: GenerateRequest) -> AsyncIterator[StreamItem]:
        rids = [f"{req.request_id}-{j}" for j in range(req.num_choices)]
        prompts = [req.prompt_token_ids] * req.num_choices
        if req.handoff is not None and self.pd.source is not None:
            await import_handoff(self.loop, self.pd.source, req.handoff, self.pd.timeout_s)
        elif self.fetcher is not None and wants_cache(req):
            try:  # a resumed choice's sequence reaches into its answer: fetch the deepest
                await self.fetcher.prefetch(self.loop, req.longest_sequence())
            except Exception:  # noqa: BLE001 - the store is an optimisation; the request runs anyway
                logger.warning("prefetch from the checkpoint store failed", exc_info=True)
        try:
            stream = await self.loop.submit(rids, prompts, req.params, req.output_prefixes, req.prefill_only)
        except ValueError as exc:
            yield GenerateError(str(exc), param="prompt")
            return
        handed_off = False
        try:
            yield Accepted(req.num_choices)
            clock, not_before = asyncio.get_running_loop(), 0.0
            while (batch := await stream.next_batch(not_before)) is not None:
                handed_off |= any(delta.finish_reason == HANDOFF for _, delta in batch)
                yield [_chunk(i, delta) for i, delta in batch]
                not_before = clock.time() + self.pacing.gap(self.loop.num_streams)
        finally:
            stream.close()
        if handed_off:
            assert self.pd.stash is not None
            yield Handoff(await export_handoff(self.loop, self.pd.stash, self.pd.replica_id, req.prompt_token_ids))

    def take_handoff(self, key: str) -> CheckpointPayload | None:
        """A stashed hand-off, once (the decode replica's pull)."""
        assert self.pd.stash is not None
        return self.pd.stash.take(key)

    async def flush_cache(self) -> bool:
        """Empty the prefix cache; False when the engine has no prefix cache to flush.

        Cache events up to and including the flush are dropped: the caller clears this
        replica's entries in the router index instead.
        """

        def flush(engine: Engine) -> bool:
            engine.drain_cache_events()
            engine.flush_cache()
            engine.drain_cache_events()
            return engine.config.cache.enable_prefix_cache

        return await self.loop.run(flush)

    async def stats(self, replica_id: str, label: str) -> ReplicaStats:
        num_streams = self.loop.num_streams  # read here, on the event loop's thread
        times = dict(self.loop.times._asdict())

        def read(engine: Engine) -> ReplicaStats:
            return ReplicaStats(
                replica_id,
                label,
                num_streams,
                bool(engine.has_unfinished()),
                engine.pool_counts(),
                engine.stats.snapshot(),
                loop=times,
                pid=os.getpid(),
            )

        return await self.loop.run(read)

    def check_health(self) -> None:
        if self.loop.error is not None:
            raise RuntimeError(f"engine loop failed: {self.loop.error!r}")
        self.loop.engine.check_workers()  # TP: every other rank alive

    async def shutdown(self) -> None:
        await self.loop.shutdown()


@dataclass(frozen=True)
class PDSide:
    """A replica's part in prefill/decode disaggregation: where it pulls hand-offs from
    (``source``; decode replicas) and where it keeps those it exports (``stash``)."""

    timeout_s: float
    source: HandoffSource | None = None
    stash: HandoffStash | None = None
    replica_id: str = "local"


def _chunk(index: int, delta: OutputDelta) -> GenerateChunk:
    """A choice's delta as the ingress receives it (prompt logprobs ride on its first)."""
    return GenerateChunk(
        index=index,
        new_token_ids=delta.new_token_ids,
        delta_text=delta.delta_text,
        logprobs=delta.logprobs,
        finished=delta.finished,
        finish_reason=delta.finish_reason,
        stop_reason=delta.stop_reason,
        cached_tokens=delta.cached_tokens,
        prompt_logprobs=delta.prompt_logprobs,
        cumulative_logprob=delta.cumulative_logprob,
    )
