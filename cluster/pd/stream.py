"""One request across a prefill and a decode replica, as one replica stream (the ingress side).

``PDStream`` is a ``GenerateStream``: the consumer (``ResumableStream``, the OpenAI server)
sees ``Accepted`` | ``GenerateError`` then chunk lists, as from one colocated replica.

1. ``direct`` (the route says a decode replica's cache leaves little to compute): the whole
   request goes to the decode deployment.
2. ``prefill``: the request runs ``prefill_only`` on a prefill replica; its first tokens
   are passed on (a choice's ``handoff`` finish shown as not finished), then the choices
   that go on are sent to the decode deployment with those tokens as ``output_prefixes``
   and the ``Handoff``'s ticket. The decode replica replays the tokens (max_tokens,
   penalties, grammar, detokenizer, stop strings: as one run) and sends only what follows.
   The client's ``cached_tokens`` and ``prompt_logprobs`` are the prefill replica's; the
   decode leg's ``cumulative_logprob`` gets the first tokens' added.
3. ``fallback``: a prefill replica that fails or refuses to accept (overloaded, dead)
   before the hand-off costs a local prefill on the decode replica -- the choices without
   a token go there whole, those with one go on from it without a ticket.

A decode leg that fails raises: the ``ResumableStream`` around this stream resumes it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from cluster.serving.engine_client import EngineClient, GenerateStream
from cluster.serving.messages import Accepted, GenerateChunk, GenerateError, GenerateRequest, Handoff
from workers.output_processor import HANDOFF

logger = logging.getLogger(__name__)


@dataclass
class _Choice:
    tokens: list[int] = field(default_factory=list)
    finished: bool = False
    started: bool = False
    cached_tokens: int = 0
    cumulative_logprob: float | None = None


class PDStream:
    def __init__(
        self,
        prefill: EngineClient,
        decode: EngineClient,
        req: GenerateRequest,
        direct: Callable[[GenerateRequest], object],
        count: Callable[[str], None],
    ) -> None:
        self.prefill, self.decode, self.req = prefill, decode, req
        self._direct, self._count = direct, count  # ``direct``: awaitable bool (the route)
        self._current: GenerateStream | None = None
        self._gen = self._run()

    def __aiter__(self) -> PDStream:
        return self

    async def __anext__(self) -> object:
        return await self._gen.__anext__()

    def cancel(self) -> None:
        stream, self._current = self._current, None
        if stream is not None:
            stream.cancel()

    async def _run(self) -> AsyncIterator[object]:
        req = self.req
        if await self._direct(req):  # type: ignore[misc]
            self._count("direct")
            async for item in self._leg(self.decode, req):
                yield item
            return
        choices = [_Choice() for _ in req.params]
        ticket, accepted = None, False
        try:
            stream = self._current = self.prefill.generate(replace(req, prefill_only=True))
            async for item in stream:
                if isinstance(item, GenerateError):
                    yield item  # bad input: refused as a colocated replica refuses it
                    return
                if isinstance(item, Accepted):
                    accepted = True
                    self._count("prefill")
                    yield item
                elif isinstance(item, Handoff):
                    ticket = item.ticket
                else:
                    yield [_first_part(choices, c) for c in item]
        except Exception as exc:  # noqa: BLE001 - the prefill replica failed: prefill on the decode side
            logger.warning("stream %s: prefill replica failed (%r); the decode replica prefills", req.request_id, exc)
            self._count("fallback")
        self._current = None
        todo = [j for j, c in enumerate(choices) if not c.finished]
        if not todo:
            return
        if not accepted:
            yield Accepted(req.num_choices)
        decode_req = GenerateRequest(
            f"{req.request_id}-d",
            req.prompt_token_ids,
            [replace(req.params[j], prompt_logprobs=None) if choices[j].started else req.params[j] for j in todo],
            req.prompt,
            output_prefixes=tuple(tuple(choices[j].tokens) for j in todo),
            handoff=ticket,
        )
        async for item in self._leg(self.decode, decode_req, skip_accepted=True):
            yield [_second_part(choices, todo, c) for c in item]  # type: ignore[union-attr]

    async def _leg(self, client: EngineClient, req: GenerateRequest, skip_accepted: bool = False) -> AsyncIterator:
        stream = self._current = client.generate(req)
        async for item in stream:
            if isinstance(item, Accepted) and skip_accepted:
                continue
            if isinstance(item, GenerateError) and skip_accepted:
                raise RuntimeError(f"the decode replica refused the handed-off request: {item.message}")
            yield item
        self._current = None


def _first_part(choices: list[_Choice], c: GenerateChunk) -> GenerateChunk:
    """A prefill-leg chunk as the client sees it (a hand-off is no finish)."""
    choice = choices[c.index]
    choice.tokens.extend(c.new_token_ids)
    choice.started, choice.cached_tokens = True, c.cached_tokens
    choice.cumulative_logprob = c.cumulative_logprob
    if c.finish_reason == HANDOFF:
        return replace(c, finished=False, finish_reason=None)
    choice.finished = c.finished
    return c


def _second_part(choices: list[_Choice], todo: list[int], c: GenerateChunk) -> GenerateChunk:
    """A decode-leg chunk under its original index, with the prefill leg's share."""
    j = todo[c.index]
    choice = choices[j]
    cumulative = c.cumulative_logprob
    if cumulative is not None and choice.cumulative_logprob is not None:
        cumulative += choice.cumulative_logprob
    cached = choice.cached_tokens if choice.started else c.cached_tokens
    return replace(c, index=j, cumulative_logprob=cumulative, cached_tokens=cached)
