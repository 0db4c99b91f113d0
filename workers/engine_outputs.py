"""The engine's side of results: append sampled tokens, decide the finishes the engine
owns (EOS, stop token ids, ``max_tokens``, the context length), emit ``EngineOutput``s.

Pure Python over Request objects; the engine calls it once per processed batch, O(new
tokens) per request. Text -- detokenization and stop strings -- is the front-end's
(``workers.output_processor``); a stop string it finds comes back as ``Engine.stop``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from workers.outputs import EngineOutput
from workers.request import FinishReason, Request, RequestStatus, TokenLogprob
from workers.stats import EngineStats


class EngineOutputs:
    def __init__(
        self,
        stats: EngineStats,
        max_model_len: int,
        release: Callable[[Request, bool], None],
        on_finish: Callable[[Request], None],
    ) -> None:
        self.stats = stats
        self.max_model_len = max_model_len
        self._release = release
        self._on_finish = on_finish
        self.requests: dict[str, Request] = {}

    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req

    def append(self, req: Request, token_ids: list[int], logprobs: list[TokenLogprob | None]) -> EngineOutput:
        """Append tokens (several for an accepted speculation) until one finishes the request."""
        if req.first_token_time is None:
            now = req.first_token_time = time.monotonic()
            self.stats.observe("hybridserve_time_to_first_token_seconds", now - req.arrival_time)
        if req.params.max_tokens == 0:  # prefill only: the token sampled after the prompt is dropped
            self.finish(req, FinishReason.LENGTH)
            return self.output(req, [], None)
        p, out = req.params, req.output_token_ids
        # The cheap test first: any token that may end the request (then _check_stop says how).
        eos = None if p.ignore_eos else req.eos_token_id
        limit = min(p.max_tokens, self.max_model_len - len(req.prompt_token_ids))
        added = token_ids
        for n, token_id in enumerate(token_ids):
            out.append(token_id)
            if token_id == eos or len(out) >= limit or token_id in p.stop_token_ids:
                added = token_ids[: n + 1]
                self.finish(req, self._check_stop(req, token_id))
                break
        kept = [lp for lp in logprobs[: len(added)] if lp is not None] if p.needs_logprobs else None
        return self.output(req, added, kept)

    def add_prompt_logprobs(self, req: Request, first: int, entries: list[TokenLogprob]) -> None:
        """Entries for prompt positions first, first + 1, ...; those already held (a
        recompute after preemption) are skipped, so each position is filled once, in order."""
        if req.is_finished:
            return
        have = len(req.prompt_logprobs)
        assert first <= have, f"{req.request_id}: prompt logprobs from {first}, only {have} held"
        req.prompt_logprobs.extend(entries[have - first :])

    @staticmethod
    def _check_stop(req: Request, token_id: int) -> FinishReason:
        """Why ``token_id`` ends the request (``append`` found that it does). EOS and stop
        tokens are blocked by the sampler until min_tokens; one that comes earlier was the
        only token a grammar allowed, and it ends the request."""
        p = req.params
        if token_id == req.eos_token_id and not p.ignore_eos:
            return FinishReason.STOP
        if token_id in p.stop_token_ids:
            req.stop_reason = token_id
            return FinishReason.STOP
        return FinishReason.LENGTH

    def finish(self, req: Request, reason: FinishReason) -> None:
        self._release(req, reason is not FinishReason.ABORT)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.finished_time = time.monotonic()
        self._on_finish(req)
        self.stats.inc("hybridserve_requests_total", label=reason.value)
        self.stats.observe("hybridserve_e2e_request_latency_seconds", req.finished_time - req.arrival_time)
        if req.first_token_time is not None and req.num_output_tokens > 1:
            tpot = (req.finished_time - req.first_token_time) / (req.num_output_tokens - 1)
            self.stats.observe("hybridserve_time_per_output_token_seconds", tpot)

    def output(self, req: Request, new_ids: list[int], new_logprobs: list[TokenLogprob] | None) -> EngineOutput:
        """The request's news; its prompt logprobs ride on the first output (``prompt_sent``)."""
        finished = req.is_finished
        prompt = None
        if req.params.prompt_logprobs is not None and not req.prompt_sent and (new_ids or finished):
            req.prompt_sent = True
            prompt = req.prompt_logprobs
        if finished:
            self.requests.pop(req.request_id, None)
        return EngineOutput(
            req.request_id,
            new_ids,
            new_logprobs,
            finished,
            req.finish_reason.value if req.finish_reason else None,
            req.stop_reason if isinstance(req.stop_reason, int) else None,
            req.num_cached_tokens,
            prompt,
        )
