"""``PDEngineClient``: the ingress's ``EngineClient`` over a prefill and a decode deployment.

Each request is routed once (``route``): to the decode deployment directly when the
deepest checkpoint a decode replica holds for its prompt (device or host, as the router
index knows it: ``DecodeDepth``) leaves at most ``max_local_prefill_tokens`` to compute --
a follow-up turn, a short prompt -- else through a prefill replica (``PDStream``). The
decode deployment's own router then picks the replica holding that checkpoint. Routes are
counted in ``hybridserve_pd_requests_total{route}``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from cluster.pd.stream import PDStream
from cluster.serving.engine_client import EngineClient, GenerateStream
from cluster.serving.messages import GenerateRequest, ModelInfo

logger = logging.getLogger(__name__)
DecodeDepth = Callable[[list[int]], Awaitable[int]]  # deepest decode-side checkpoint of a prompt


class PDEngineClient:
    def __init__(
        self,
        prefill: EngineClient,
        decode: EngineClient,
        decode_depth: DecodeDepth,
        max_local_prefill_tokens: int,
        count: Callable[[str], None] = lambda route: None,
    ) -> None:
        self.prefill, self.decode = prefill, decode
        self.decode_depth, self.max_local = decode_depth, max_local_prefill_tokens
        self.count = count

    async def model_info(self) -> ModelInfo:
        return await self.decode.model_info()

    def generate(self, req: GenerateRequest) -> GenerateStream:
        return PDStream(self.prefill, self.decode, req, self.route, self.count)

    async def route(self, req: GenerateRequest) -> bool:
        """True: straight to the decode deployment (its cache leaves little to compute)."""
        if req.output_prefixes:  # a stream resumed after its replica failed: no new prefill
            return True
        prompt = req.prompt_token_ids
        if len(prompt) - 1 <= self.max_local:  # the last prompt token is always computed
            return True
        try:
            depth = await self.decode_depth(prompt)
        except Exception:  # noqa: BLE001 - the index is an optimisation: prefill as if cold
            logger.warning("decode-side depth lookup failed", exc_info=True)
            depth = 0
        return len(prompt) - depth <= self.max_local

    async def flush_cache(self) -> list[dict[str, Any]]:
        return [*await self.prefill.flush_cache(), *await self.decode.flush_cache()]

    async def replica_stats(self) -> list[dict[str, Any]]:
        prefill = [{**s, "pd_role": "prefill"} for s in await self.prefill.replica_stats()]
        decode = [{**s, "pd_role": "decode"} for s in await self.decode.replica_stats()]
        return prefill + decode

    async def health(self) -> None:
        await self.prefill.health()
        await self.decode.health()

    async def metrics_text(self) -> str:
        return await self.decode.metrics_text()  # one metrics actor per app: every replica's series
