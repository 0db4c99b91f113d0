"""Host side of batched sampling: one step's ``SamplingInputs``, built at launch.

Runs on the scheduler thread, from the step's frozen batch (positions, widths) and the
requests' params, in one pass over the sampling sequences; the device work it sets up
is batched over every row (``workers.sampling.processors``). Rule used throughout: at
launch every token before a sequence's first input row is known on the host (the
overlap lag is one sampling step and a verify's request is not scheduled again until
its acceptance is processed), so only the step's own input rows can be placeholders.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workers.request import Request
from workers.sampling.inputs import (
    BadWordInputs,
    GrammarRows,
    PenaltyInputs,
    PromptInputs,
    RowFilters,
    RowTokens,
    SamplingInputs,
)
from workers.sampling.requests import RequestSampling, request_sampling
from workers.sampling.seeded import SeededSeq
from workers.scheduler_types import ScheduledSeq


def _t(values: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def _opt(values: list, dtype: torch.dtype = torch.int64) -> torch.Tensor | None:
    return _t(values, dtype) if values else None


class RegisterRows:
    """Penalty register rows per request, keyed by its engine handle and admission: a
    request readmitted after preemption gets its registers rebuilt from the host's tokens."""

    def __init__(self) -> None:
        self._rows: dict[int, tuple[int, int]] = {}
        self._free: list[int] = []
        self.capacity = 0

    def assign(self, handle: int, admission: int) -> tuple[int, bool]:
        """(row, fresh): fresh rows must be initialised before this step reads them."""
        held = self._rows.get(handle)
        if held is not None and held[1] == admission:
            return held[0], False
        if held is not None:
            row = held[0]
        elif self._free:
            row = self._free.pop()
        else:
            row, self.capacity = self.capacity, self.capacity + 1
        self._rows[handle] = (row, admission)
        return row, True

    def release(self, handle: int) -> None:
        held = self._rows.pop(handle, None)
        if held is not None:
            self._free.append(held[0])


@dataclass
class _Rows:
    """The flat lists of one step, filled seq by seq."""

    greedy: list[bool] = field(default_factory=list)
    temperature: list[float] = field(default_factory=list)
    top_k: list[int] = field(default_factory=list)
    top_p: list[float] = field(default_factory=list)
    min_p: list[float] = field(default_factory=list)
    bias: list[tuple[int, int, float]] = field(default_factory=list)
    blocked: list[tuple[int, int]] = field(default_factory=list)
    pen: list[tuple[int, int, float, float, float]] = field(default_factory=list)
    pen_drafts: list[tuple[int, int]] = field(default_factory=list)
    init: list[tuple[int, list[int], list[int]]] = field(default_factory=list)
    seq_registers: list[int] = field(default_factory=list)
    words: list[tuple[int, int, tuple[int, ...], int]] = field(default_factory=list)  # row, pos, word, seq
    logprob_seqs: list[int] = field(default_factory=list)
    max_top: int = 0
    grammar: list[GrammarRows] = field(default_factory=list)
    widths: list[int] = field(default_factory=list)
    seeded: list[SeededSeq] = field(default_factory=list)


def sampling_of(req: Request) -> RequestSampling:
    """The request's resolved sampling info (set by the engine; built here for bare requests)."""
    if req.sampling is None:
        req.sampling = request_sampling(req.params, req.eos_token_id, None)
    return req.sampling


class SamplingPlanner:
    """Builds ``SamplingInputs``; owns the penalty register rows and the grammar drops."""

    def __init__(self) -> None:
        self.registers = RegisterRows()
        self._grammar_drops: list[int] = []

    def drop(self, req: Request) -> None:
        """The request finished (host thread): its rows return, its matcher goes."""
        self.registers.release(req.handle)
        if req.params.structured_output is not None:
            self._grammar_drops.append(req.handle)

    def build(self, seqs: tuple[ScheduledSeq, ...]) -> SamplingInputs:
        plain = self._plain(seqs)
        if plain is not None:
            return plain
        rows = _Rows()
        first_inputs, first_input = [], 0
        for seq in seqs:
            first_inputs.append(first_input)
            if seq.samples:
                self._add_sampling_seq(rows, seq, first_input)
            first_input += seq.num_new_tokens
        drops, self._grammar_drops = tuple(self._grammar_drops), []
        return SamplingInputs(
            widths=tuple(rows.widths),
            filters=None if all(rows.greedy) else _filters(rows),
            logprob_seqs=tuple(rows.logprob_seqs),
            max_top_logprobs=rows.max_top,
            bias=RowTokens(
                _t([r for r, _, _ in rows.bias]),
                _t([t for _, t, _ in rows.bias]),
                _t([v for _, _, v in rows.bias], torch.float32),
            )
            if rows.bias
            else None,
            blocked=RowTokens(_t([r for r, _ in rows.blocked]), _t([t for _, t in rows.blocked]))
            if rows.blocked
            else None,
            penalties=self._penalties(rows),
            bad_words=_bad_words(rows, seqs, first_inputs, first_input),
            grammar=tuple(rows.grammar),
            grammar_drops=drops,
            prompt=_prompt_inputs(seqs, first_inputs),
            seeded=tuple(rows.seeded),
        )

    def _plain(self, seqs: tuple[ScheduledSeq, ...]) -> SamplingInputs | None:
        """The inputs of a step whose every sampling request is plain (``RequestSampling``):
        per row only its filters, none at all when every one is greedy; None otherwise."""
        widths, params, seeded = [], [], []
        for seq in seqs:
            if not sampling_of(seq.request).plain:  # a chunk may owe prompt logprobs too
                return None
            if seq.samples:
                p = seq.request.params
                if p.seed is not None and not p.is_greedy:
                    seeded.append(_seeded(len(widths), seq))
                widths.append(seq.num_new_tokens if seq.is_verify else 1)
                params.append(p)
        drops, self._grammar_drops = tuple(self._grammar_drops), []
        filters = None
        if not all(p.is_greedy for p in params):
            rows = _Rows()
            for p, width in zip(params, widths):
                rows.greedy += [p.is_greedy] * width
                rows.temperature += [1.0 if p.is_greedy else p.temperature] * width
                rows.top_k += [p.effective_top_k] * width
                rows.top_p += [p.top_p] * width
                rows.min_p += [p.min_p] * width
            filters = _filters(rows)
        return SamplingInputs(
            widths=tuple(widths),
            filters=filters,
            logprob_seqs=(),
            max_top_logprobs=0,
            grammar_drops=drops,
            seeded=tuple(seeded),
        )

    def _add_sampling_seq(self, rows: _Rows, seq: ScheduledSeq, first_input: int) -> None:
        req, p = seq.request, seq.request.params
        info = sampling_of(req)
        n, first_row = len(rows.widths), len(rows.greedy)
        positions = list(range(seq.start, seq.end)) if seq.is_verify else [seq.end - 1]
        if p.seed is not None and not p.is_greedy:
            rows.seeded.append(_seeded(n, seq))
        rows.widths.append(len(positions))
        register = self._register(rows, req) if p.uses_penalties else -1
        rows.seq_registers.append(register)
        for i, pos in enumerate(positions):
            r = first_row + i
            rows.greedy.append(p.is_greedy)
            rows.temperature.append(1.0 if p.is_greedy else p.temperature)
            rows.top_k.append(p.effective_top_k)
            rows.top_p.append(p.top_p)
            rows.min_p.append(p.min_p)
            num_out = pos + 1 - req.num_prompt_tokens  # outputs before the token this row samples
            rows.bias.extend((r, t, v) for t, v in p.logit_bias)
            if num_out < p.min_tokens:
                rows.blocked.extend((r, t) for t in info.blocked_ids)
            rows.words.extend((r, pos, w, len(rows.widths) - 1) for w in info.bad_words_ids if num_out >= len(w) - 1)
            if register >= 0:
                k = len(rows.pen)
                rows.pen.append((r, register, p.repetition_penalty, p.frequency_penalty, p.presence_penalty))
                rows.pen_drafts.extend((k, first_input + j) for j in range(1, i + 1))
        if p.needs_logprobs:
            rows.logprob_seqs.append(n)
            rows.max_top = max(rows.max_top, p.logprobs or 0)
        if p.structured_output is not None:
            drafts = tuple(first_input + j for j in range(1, seq.num_new_tokens)) if seq.is_verify else ()
            replay = tuple(req.output_token_ids[: req.num_resumed_outputs])
            rows.grammar.append(GrammarRows(n, req.handle, p.structured_output, first_row, drafts, replay))

    def _register(self, rows: _Rows, req: Request) -> int:
        register, fresh = self.registers.assign(req.handle, req.num_preemptions)
        if fresh:  # only this step's own token may be in flight (on_launch counted it)
            assert req.num_pending_tokens <= 1, (
                f"request {req.request_id}: registers built with {req.num_pending_tokens} tokens in flight"
            )
            rows.init.append((register, req.prompt_token_ids, list(req.output_token_ids)))
        return register

    def _penalties(self, rows: _Rows) -> PenaltyInputs | None:
        if not rows.pen:
            return None
        prompt = [(reg, t) for reg, ids, _ in rows.init for t in ids]
        output = [(reg, t) for reg, _, ids in rows.init for t in ids]
        return PenaltyInputs(
            rows=_t([x[0] for x in rows.pen]),
            registers=_t([x[1] for x in rows.pen]),
            repetition=_t([x[2] for x in rows.pen], torch.float32),
            frequency=_t([x[3] for x in rows.pen], torch.float32),
            presence=_t([x[4] for x in rows.pen], torch.float32),
            draft_rows=_opt([k for k, _ in rows.pen_drafts]),
            draft_inputs=_opt([i for _, i in rows.pen_drafts]),
            init_registers=tuple(reg for reg, _, _ in rows.init),
            init_prompt=_opt([t for _, t in prompt]),
            init_prompt_reg=_opt([r for r, _ in prompt]),
            init_output=_opt([t for _, t in output]),
            init_output_reg=_opt([r for r, _ in output]),
            seq_registers=tuple(rows.seq_registers),
            capacity=self.registers.capacity,
        )


def _seeded(n: int, seq: ScheduledSeq) -> SeededSeq:
    """Sampling sequence ``n``: its first row samples the token after its first sampling row
    (a verify samples after every row, a decode or a chunk after its last)."""
    first = seq.start if seq.is_verify else seq.end - 1
    return SeededSeq(n, first + 1, seq.is_chained)


def _filters(rows: _Rows) -> RowFilters:
    def used(values: list, off: object, dtype: torch.dtype) -> torch.Tensor | None:
        return _t(values, dtype) if any(v != off for v, g in zip(values, rows.greedy) if not g) else None

    return RowFilters(
        greedy=_t(rows.greedy, torch.bool),
        temperature=_t(rows.temperature, torch.float32),
        top_k=used(rows.top_k, 0, torch.int64),
        top_p=used(rows.top_p, 1.0, torch.float32),
        min_p=used(rows.min_p, 0.0, torch.float32),
    )


def _bad_words(
    rows: _Rows, seqs: tuple[ScheduledSeq, ...], first_inputs: list[int], num_inputs: int
) -> BadWordInputs | None:
    """Right-aligned prefix windows of width W; tokens before a sequence's first input
    row come from the host (``history``), the rest from the step's input rows."""
    if not rows.words:
        return None
    width = max(1, max(len(w) - 1 for _, _, w, _ in rows.words))
    sampling = [b for b, s in enumerate(seqs) if s.samples]
    history: list[int] = []
    base: dict[int, tuple[int, int]] = {}  # sampling seq -> (offset in history, first position)
    prefix, gather = [], []
    for _, pos, word, n in rows.words:
        b = sampling[n]
        seq = seqs[b]
        if n not in base:
            lo = max(0, seq.start - width)
            assert seq.start <= seq.request.num_tokens, "tokens before a sequence's inputs must be known"
            base[n] = (len(history), lo)
            history.extend(seq.request.token_slice(lo, seq.start))
        off, lo = base[n]
        pad = width - (len(word) - 1)
        prefix.append([-1] * pad + list(word[:-1]))
        cols = []
        for c in range(width):
            p = pos - (width - 1) + c
            if p >= seq.start:
                cols.append(first_inputs[b] + p - seq.start)
            else:
                cols.append(num_inputs + off + (p - lo) if p >= lo else 0)
        gather.append(cols)
    return BadWordInputs(
        rows=_t([r for r, _, _, _ in rows.words]),
        banned=_t([w[-1] for _, _, w, _ in rows.words]),
        prefix=_t(prefix),
        gather=_t(gather),
        history=_t(history or [0]),
    )


def _prompt_inputs(seqs: tuple[ScheduledSeq, ...], first_inputs: list[int]) -> PromptInputs | None:
    """Rows at positions p < prompt_len - 1 score prompt token p + 1; positions whose
    logprob the request already holds (a recompute after preemption) are skipped."""
    hidden, targets, out = [], [], []
    for b, seq in enumerate(seqs):
        req = seq.request
        k = req.params.prompt_logprobs
        if k is None:
            continue
        lo = max(seq.start, len(req.prompt_logprobs) - 1)
        hi = min(seq.end, req.num_prompt_tokens - 1)
        if hi <= lo:
            continue
        hidden.extend(first_inputs[b] + p - seq.start for p in range(lo, hi))
        targets.extend(req.prompt_token_ids[lo + 1 : hi + 1])
        out.append((b, lo + 1, hi - lo, k))
    if not out:
        return None
    return PromptInputs(_t(hidden), _t(targets), tuple(out))
