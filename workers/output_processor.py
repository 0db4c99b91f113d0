"""Host-side result handling: append sampled tokens, detokenize, decide stops, build outputs.

Pure Python over Request objects; the engine calls it once per processed batch.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from workers.detokenizer import IncrementalDetokenizer
from workers.outputs import RequestOutput
from workers.request import FinishReason, Request, RequestStatus, TokenLogprob
from workers.stats import EngineStats


class OutputProcessor:
    def __init__(self, tokenizer, stats: EngineStats, max_model_len: int,
                 release: Callable[[Request, bool], None], on_finish: Callable[[Request], None]) -> None:
        self.tokenizer = tokenizer
        self.stats = stats
        self.max_model_len = max_model_len
        self._release = release
        self._on_finish = on_finish
        self.requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}

    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        p = req.params
        self._detok[req.request_id] = IncrementalDetokenizer(
            self.tokenizer, p.stop, p.include_stop_str_in_output, p.skip_special_tokens)

    def append(self, req: Request, token_ids: list[int],
               logprobs: list[TokenLogprob | None]) -> RequestOutput:
        """Append tokens (several for an accepted speculation) until one finishes the request."""
        now = time.monotonic()
        if req.first_token_time is None:
            req.first_token_time = now
            self.stats.observe("hybridserve_time_to_first_token_seconds", now - req.arrival_time)
        added: list[int] = []
        if req.params.max_tokens == 0:        # prefill only: the token sampled after the prompt is dropped
            self.finish(req, FinishReason.LENGTH)
            return self.output(req, added)
        for token_id, logprob in zip(token_ids, logprobs):
            req.output_token_ids.append(token_id)
            added.append(token_id)
            if logprob is not None:
                req.cumulative_logprob += logprob.logprob
                if req.params.logprobs is not None:
                    req.output_logprobs.append(logprob)
            self.stats.inc("hybridserve_generation_tokens_total")
            stop_str = self._detok[req.request_id].append(token_id, req.num_output_tokens >= req.params.min_tokens)
            reason = self._check_stop(req, token_id, stop_str)
            if reason is not None:
                self.finish(req, reason)
                break
        return self.output(req, added)

    def add_prompt_logprobs(self, req: Request, first: int, entries: list[TokenLogprob]) -> None:
        """Entries for prompt positions first, first + 1, ...; those already held (a
        recompute after preemption) are skipped, so each position is filled once, in order."""
        if req.is_finished:
            return
        have = len(req.prompt_logprobs)
        assert first <= have, f"{req.request_id}: prompt logprobs from {first}, only {have} held"
        req.prompt_logprobs.extend(entries[have - first:])

    def _check_stop(self, req: Request, token_id: int, stop_str: str | None) -> FinishReason | None:
        """Stop strings count from min_tokens on. EOS and stop tokens are blocked by the
        sampler until min_tokens; one that comes earlier was the only token a grammar
        allowed, and it ends the request."""
        p = req.params
        if stop_str is not None and req.num_output_tokens >= p.min_tokens:
            req.stop_reason = stop_str
            return FinishReason.STOP
        if token_id == req.eos_token_id and not p.ignore_eos:
            return FinishReason.STOP
        if token_id in p.stop_token_ids:
            req.stop_reason = token_id
            return FinishReason.STOP
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def finish(self, req: Request, reason: FinishReason) -> None:
        self._release(req, reason is not FinishReason.ABORT)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.finished_time = time.monotonic()
        self._detok[req.request_id].flush()
        self._on_finish(req)
        self.stats.inc("hybridserve_requests_total", label=reason.value)
        self.stats.observe("hybridserve_e2e_request_latency_seconds", req.finished_time - req.arrival_time)
        if req.first_token_time is not None and req.num_output_tokens > 1:
            tpot = (req.finished_time - req.first_token_time) / (req.num_output_tokens - 1)
            self.stats.observe("hybridserve_time_per_output_token_seconds", tpot)

    def output(self, req: Request, new_ids: list[int]) -> RequestOutput:
        detok = self._detok[req.request_id]
        finished = req.is_finished
        out = RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids), text=detok.text,
            cached_tokens=req.num_cached_tokens, finished=finished,
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            stop_reason=req.stop_reason, new_token_ids=new_ids,
            delta_text=detok.stream_delta(finished),
            logprobs=list(req.output_logprobs) if req.params.logprobs is not None else None,
            prompt_logprobs=list(req.prompt_logprobs) if req.params.prompt_logprobs is not None else None,
            cumulative_logprob=req.cumulative_logprob if req.params.needs_logprobs else None)
        if finished:
            self.requests.pop(req.request_id, None)
            self._detok.pop(req.request_id, None)
        return out
