"""The front-end's side of results: token-id deltas from the engine become text.

Runs on the consumer's thread (the offline ``LLM``'s caller; a replica's event loop), never
on the engine's: incremental detokenization, stop strings, logprob lists and the
``OutputDelta`` / ``RequestOutput`` objects. A stop string ends the request here, exactly
where it must (its token is the last kept, the text cut at the string); ``process``
returns the request's id among ``stop`` so the caller ends it in the engine too
(``Engine.stop``). The engine may have produced a few more tokens by then: they are
dropped here, never shown.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from workers.detokenizer import Decoder, IncrementalDetokenizer
from workers.outputs import EngineOutput, OutputDelta, RequestOutput
from workers.request import TokenLogprob
from workers.sampling.params import SamplingParams

HANDOFF = "handoff"  # a prefill replica's finish: the decode replica continues the output


class Processed(NamedTuple):
    deltas: list[OutputDelta]
    stop: list[str]  # requests a stop string ended here: end them in the engine too


@dataclass
class _Tracked:
    prompt_token_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    last_ids: list[int] = field(default_factory=list)
    handoff: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OutputProcessor:
    def __init__(self, tokenizer: Decoder) -> None:
        self.tokenizer = tokenizer
        self._tracked: dict[str, _Tracked] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._tracked

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_prefix: Sequence[int] = (),
        handoff: bool = False,
    ) -> None:
        """``output_prefix``: the request's first outputs, generated and sent elsewhere (a
        prefill/decode hand-off): replayed through the detokenizer, not sent again -- the text
        it holds back (a possible stop string) comes with what follows, as in one run.
        ``handoff``: the engine runs this request to its first token only; that finish by
        length is a hand-off (``finish_reason`` ``handoff``), which sends no held-back text."""
        detok = IncrementalDetokenizer(
            self.tokenizer, params.stop, params.include_stop_str_in_output, params.skip_special_tokens
        )
        for n, token_id in enumerate(output_prefix):
            if detok.append(token_id, n + 1 >= params.min_tokens) is not None:
                raise ValueError(f"output prefix token {n} completes a stop string: that output had finished")
        detok.stream_delta(False)  # sent with the prefix
        self._tracked[request_id] = _Tracked(
            prompt_token_ids,
            params,
            detok,
            token_ids=list(output_prefix),
            logprobs=[] if params.logprobs is not None else None,
            cumulative_logprob=0.0 if params.needs_logprobs else None,
            handoff=handoff,
        )

    def process(self, outputs: Iterable[EngineOutput]) -> Processed:
        """Deltas for the outputs of requests this processor tracks (others are skipped);
        nothing more once a request has finished here."""
        deltas, stop = [], []
        for out in outputs:
            t = self._tracked.get(out.request_id)
            if t is None or t.finished:
                continue
            delta = self._advance(t, out)
            if delta.finished and not out.finished:
                stop.append(out.request_id)
            deltas.append(delta)
        return Processed(deltas, stop)

    def final(self, request_id: str) -> RequestOutput:
        """A finished request's whole output; the processor forgets it."""
        t = self._tracked.pop(request_id)
        assert t.finished, request_id
        return RequestOutput(
            request_id=request_id,
            prompt_token_ids=t.prompt_token_ids,
            token_ids=t.token_ids,
            text=t.detok.text,
            cached_tokens=t.cached_tokens,
            finished=True,
            finish_reason=t.finish_reason,
            stop_reason=t.stop_reason,
            new_token_ids=t.last_ids,
            delta_text="",
            logprobs=t.logprobs,
            prompt_logprobs=t.prompt_logprobs,
            cumulative_logprob=t.cumulative_logprob,
        )

    def discard(self, request_id: str) -> None:
        self._tracked.pop(request_id, None)

    def _advance(self, t: _Tracked, out: EngineOutput) -> OutputDelta:
        p = t.params
        if out.prompt_logprobs is not None:
            t.prompt_logprobs = out.prompt_logprobs
        t.cached_tokens = out.cached_tokens
        kept = out.new_token_ids
        for n, token_id in enumerate(out.new_token_ids):
            t.token_ids.append(token_id)
            stop_str = t.detok.append(token_id, len(t.token_ids) >= p.min_tokens)
            if stop_str is not None:
                kept = out.new_token_ids[: n + 1]
                t.finish_reason, t.stop_reason = "stop", stop_str
                break
        new_lps = out.new_logprobs[: len(kept)] if out.new_logprobs is not None else None
        if new_lps is not None:
            t.cumulative_logprob = (t.cumulative_logprob or 0.0) + sum(lp.logprob for lp in new_lps)
        shown = None
        if t.logprobs is not None:
            shown = list(new_lps or ())
            t.logprobs.extend(shown)
        if not t.finished and out.finished:
            t.finish_reason, t.stop_reason = out.finish_reason, out.stop_reason
            if t.handoff and out.finish_reason == "length" and len(t.token_ids) < p.max_tokens:
                t.finish_reason = HANDOFF  # the decode side goes on: nothing is flushed
            else:
                t.detok.flush()
        t.last_ids = kept
        return OutputDelta(
            out.request_id,
            kept,
            t.detok.stream_delta(t.finished and t.finish_reason != HANDOFF),
            shown,
            t.finished,
            t.finish_reason,
            t.stop_reason,
            t.cached_tokens,
            t.cumulative_logprob,
            out.prompt_logprobs,
        )
