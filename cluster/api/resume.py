"""Resuming a replica stream elsewhere: what the ingress keeps per choice, and the request
that continues it (pure bookkeeping: no Ray, no asyncio; ``resumable.py`` drives it).

When the replica serving a ``GenerateRequest`` fails mid-stream, every unfinished choice
is re-issued to another replica as the user's prompt plus the tokens the client already
has (``GenerateRequest.continuations``); the client sees one stream. Invariants, per
choice, whatever the number of resumes:

- the tokens sent to the client are exactly ``ChoiceProgress.token_ids``, each once;
- the text sent is exactly what the replica's ``OutputProcessor`` would have sent for
  them: a resumed choice's text is detokenized here, by a detokenizer replayed over the
  tokens already sent (so a character split over the boundary, text held back as a
  possible stop string, and a stop string across the boundary all come out as in an
  undisturbed run); stop strings of a resumed choice are matched here, not on the replica;
- ``max_tokens`` and ``min_tokens`` count the tokens already sent; ``prompt_logprobs``
  and ``cached_tokens`` are the first replica's (the user's prompt, not the resumed one);
  ``cumulative_logprob`` adds the resumed part to what was sent.

A choice that has sent no token is simply re-issued as it was (a retry: exact even for
seeded sampling). One that has is resumed only when its sampling does not depend on which
tokens are output rather than prompt (``not_resumable`` says why not otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from cluster.serving.messages import GenerateChunk, GenerateRequest
from workers.detokenizer import IncrementalDetokenizer
from workers.sampling.params import SamplingParams


class NotResumable(Exception):
    """The stream cannot be continued on another replica (the message says why)."""


@dataclass
class ChoiceProgress:
    """What the client has received of one choice."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    started: bool = False  # a chunk arrived: prompt logprobs and cached tokens came with it
    cached_tokens: int = 0
    cumulative_logprob: float | None = None
    finished: bool = False


def not_resumable(params: SamplingParams) -> str | None:
    """Why a choice that has output tokens cannot continue from a longer prompt, or None."""
    if params.structured_output is not None:
        return "its structured-output grammar state cannot be replayed on another replica"
    if params.frequency_penalty or params.presence_penalty:
        return "frequency and presence penalties count output tokens, which a resumed prompt turns into prompt tokens"
    if params.bad_words:
        return "bad_words are matched over output tokens only"
    return None


def resumed_params(params: SamplingParams, progress: ChoiceProgress) -> SamplingParams:
    """The choice's params on the new replica (raises ``NotResumable``)."""
    k = len(progress.token_ids)
    if k == 0:  # a retry: everything as first asked, except what already came
        return replace(params, prompt_logprobs=None) if progress.started else params
    reason = not_resumable(params)
    if reason is not None:
        raise NotResumable(reason)
    # stop strings are matched here (``ResumedText``): the replica sees no text before the resume
    return replace(
        params,
        max_tokens=params.max_tokens - k,
        min_tokens=max(0, params.min_tokens - k),
        stop=(),
        prompt_logprobs=None,
    )


class ResumedText:
    """The text of a choice resumed after ``progress.token_ids``: a detokenizer replayed over
    them (the replica's rules: stops checked from ``min_tokens`` on), then fed what follows."""

    def __init__(self, tokenizer: Any, params: SamplingParams, progress: ChoiceProgress) -> None:
        self.params = params
        self.detok = IncrementalDetokenizer(
            tokenizer, params.stop, params.include_stop_str_in_output, params.skip_special_tokens
        )
        for n, token_id in enumerate(progress.token_ids):
            self.detok.append(token_id, n + 1 >= params.min_tokens)
        replayed = self.detok.stream_delta(False)
        if replayed != progress.text or self.detok.matched_stop is not None:
            raise NotResumable("the text sent so far does not replay from its tokens")
        self.base_logprob = progress.cumulative_logprob

    def rewrite(self, chunk: GenerateChunk, index: int, progress: ChoiceProgress) -> GenerateChunk:
        """``chunk`` of the resumed stream as the first replica would have sent it."""
        kept, stop = chunk.new_token_ids, None
        for n, token_id in enumerate(chunk.new_token_ids):
            stop = self.detok.append(token_id, len(progress.token_ids) + n + 1 >= self.params.min_tokens)
            if stop is not None:
                kept = chunk.new_token_ids[: n + 1]
                break
        finished = stop is not None or chunk.finished
        if stop is None and chunk.finished:
            self.detok.flush()
        logprobs = chunk.logprobs[: len(kept)] if chunk.logprobs is not None else None
        cumulative = chunk.cumulative_logprob
        if cumulative is not None:
            dropped = chunk.logprobs[len(kept) :] if chunk.logprobs is not None else []
            cumulative += (self.base_logprob or 0.0) - sum(lp.logprob for lp in dropped)
        return GenerateChunk(
            index=index,
            new_token_ids=kept,
            delta_text=self.detok.stream_delta(finished),
            logprobs=logprobs,
            finished=finished,
            finish_reason="stop" if stop is not None else chunk.finish_reason,
            stop_reason=stop if stop is not None else chunk.stop_reason,
            cached_tokens=progress.cached_tokens,
            prompt_logprobs=None,
            cumulative_logprob=cumulative,
        )


@dataclass(frozen=True)
class ResumePlan:
    request: GenerateRequest
    kind: str  # "migration" (some choice had sent tokens) or "retry" (none had)


class StreamBook:
    """The progress of every choice of one ``GenerateRequest`` across its replica streams.

    ``index_map[i]`` is the original choice of index ``i`` in the current stream; choices
    resumed after sending tokens have a ``ResumedText`` in ``texts``."""

    def __init__(self, request: GenerateRequest, tokenizer: Any) -> None:
        self.request = request
        self.tokenizer = tokenizer
        self.choices = [ChoiceProgress() for _ in request.params]
        self.index_map = list(range(request.num_choices))
        self.texts: dict[int, ResumedText] = {}
        self.num_resumes = 0

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)

    def absorb(self, chunks: list[GenerateChunk]) -> list[GenerateChunk]:
        """The current stream's chunks, as the client's (original indices; chunks of a choice
        already finished here -- cut at a stop string -- dropped)."""
        out = []
        for chunk in chunks:
            if not 0 <= chunk.index < len(self.index_map):
                raise RuntimeError(f"replica chunk for choice {chunk.index} of {len(self.index_map)}")
            j = self.index_map[chunk.index]
            progress = self.choices[j]
            if progress.finished:
                continue
            text = self.texts.get(j)
            if text is not None:
                chunk = text.rewrite(chunk, j, progress)
            elif chunk.index != j:
                chunk = replace(chunk, index=j)
            progress.token_ids.extend(chunk.new_token_ids)
            progress.text += chunk.delta_text
            if not progress.started:
                progress.started, progress.cached_tokens = True, chunk.cached_tokens
            progress.cumulative_logprob = chunk.cumulative_logprob
            progress.finished = chunk.finished
            out.append(chunk)
        return out

    def plan(self) -> ResumePlan:
        """The request continuing every unfinished choice (raises ``NotResumable``); from
        now on the book maps the new stream's chunks."""
        todo = [j for j, c in enumerate(self.choices) if not c.finished]
        assert todo, "nothing to resume"
        params = [resumed_params(self.request.params[j], self.choices[j]) for j in todo]
        texts = {
            j: ResumedText(self.tokenizer, self.request.params[j], self.choices[j])
            for j in todo
            if self.choices[j].token_ids
        }
        continuations = tuple(tuple(self.choices[j].token_ids) for j in todo)
        self.num_resumes += 1
        req = GenerateRequest(
            f"{self.request.request_id}-r{self.num_resumes}",
            self.request.prompt_token_ids,
            params,
            self.request.prompt,
            continuations if texts else (),
        )
        self.index_map = todo
        self.texts.update(texts)
        return ResumePlan(req, "migration" if texts else "retry")
