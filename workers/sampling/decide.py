"""Forward-thread side of batched sampling: process, mask, sample or verify, update.

``BatchSampler.decide`` takes the logits of every sampling row of a step and returns
each sampling sequence's tokens (one, or a verify's accepted drafts + one), raw
logprobs where asked, and drafts accepted. Order, all batched over rows: logit_bias,
bad words, min_tokens blocks, penalties (counts as of each row), the grammar bitmask,
then greedy argmax or temperature / top-k / top-p / min-p and a draw; a verify accepts
drafts against the processed rows (greedy match; rejection sampling on the processed
distributions; for a seeded row, a match with its own draw keyed by position). Then the
penalty registers and grammar matchers take the tokens.

A row every processor masked (min_tokens or a bad word against a grammar that allows
only those tokens) falls back to the grammar-masked raw logits: the grammar wins.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

import torch

from workers.request import TokenLogprob
from workers.sampling.grammar import GrammarBank, GrammarCompiler, apply_bitmask
from workers.sampling.inputs import SamplingInputs
from workers.sampling.logprobs import token_logprobs
from workers.sampling.params import SamplingParams
from workers.sampling.penalties import PenaltyState
from workers.sampling.processors import add_bias, apply_penalties, ban_bad_words, block_tokens, draw, filter_rows
from workers.sampling.sampler import GeneratorBank
from workers.sampling.seeded import position_seed
from workers.spec.acceptance import Accepted, accept_greedy_ids, accept_rejection
from workers.step_inputs import VerifyRows


@dataclass(frozen=True)
class Decision:
    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprob | None] | None]  # None: the sequence asked for none
    num_accepted: list[int | None]
    last_ids: torch.Tensor | None = None  # a sampling step's tokens, still on the device


class BatchSampler:
    def __init__(
        self, device: torch.device, generators: GeneratorBank, grammar_compiler: GrammarCompiler | None = None
    ) -> None:
        self.device = device
        self.generators = generators
        self.penalties = PenaltyState(device)
        self.grammars = GrammarBank(grammar_compiler) if grammar_compiler is not None else None
        self._accepted: dict[int, int] = {}  # live slot -> drafts its last verify accepted

    def begin(self, si: SamplingInputs) -> None:
        """Before the step: drop the matchers of requests finished before its launch."""
        if si.grammar_drops and self.grammars is not None:
            self.grammars.drop(si.grammar_drops)

    def decide(
        self,
        si: SamplingInputs,
        input_ids: torch.Tensor,
        logits: torch.Tensor,
        params: list[SamplingParams],
        gens: list[torch.Generator],
        verify: list[VerifyRows | None],
        draft_q: Callable[[VerifyRows], torch.Tensor],
    ) -> Decision:
        raw = logits.float()
        # The drafts are read with the picked tokens (one read), unless the grammar masks
        # need them before the logits are processed.
        drafts = _drafts(input_ids, verify) if si.grammar else None
        x = self.process(si, raw, input_ids, drafts)
        last = None
        if any(v is not None for v in verify):
            tokens, accepted = self._verify(si, x, input_ids, params, gens, verify, drafts, draft_q)
        else:
            last = self._sample(si, x, params, gens)
            tokens = [[t] for t in last.tolist()]
            accepted = [None] * len(tokens)
        self._advance(si, tokens)
        return Decision(tokens, self._logprobs(si, raw, tokens, params), accepted, last)

    def process(
        self, si: SamplingInputs, raw: torch.Tensor, input_ids: torch.Tensor, drafts: list[list[int]] | None
    ) -> torch.Tensor:
        """The processed logits of every row (``raw`` itself when nothing applies); ``drafts``
        (host lists per sequence) are read only by the grammar masks."""
        if not (si.bias or si.blocked or si.penalties or si.bad_words or si.grammar):
            return raw
        x = raw.clone()
        if si.bias is not None:
            add_bias(x, si.bias)
        if si.bad_words is not None:
            ban_bad_words(x, si.bad_words, input_ids)
        if si.blocked is not None:
            block_tokens(x, si.blocked)
        p = si.penalties
        if p is not None:
            self.penalties.prepare(p, x.shape[-1])
            seen, counts = self.penalties.rows(p, input_ids)
            apply_penalties(x, p.rows, seen, counts, p.repetition, p.frequency, p.presence)
        if si.grammar:
            assert self.grammars is not None, "structured output without a grammar compiler"
            assert drafts is not None, "grammar masks need the drafts"
            mask = self.grammars.bitmask(si.grammar, si.widths, [drafts[g.seq] for g in si.grammar])
            apply_bitmask(x, mask)
            if si.blocked is not None or si.bad_words is not None:
                fallback = raw.clone()
                apply_bitmask(fallback, mask)
                x = torch.where(torch.isfinite(x).any(dim=-1, keepdim=True), x, fallback)
        return x

    def _keyed(
        self,
        si: SamplingInputs,
        firsts: list[int],
        params: list[SamplingParams],
        gens: list[torch.Generator],
        verify: list[VerifyRows | None],
    ) -> list[tuple[int, torch.Generator, int | None]]:
        """(row, generator, key) for every row of the seeded sequences: each row's noise is
        keyed by the position of the token it samples (``workers.sampling.seeded``)."""
        out: list[tuple[int, torch.Generator, int | None]] = []
        for s in si.seeded:
            v, seed = verify[s.seq], params[s.seq].seed
            assert seed is not None
            # A chained verify starts after the drafts its request's verify before it accepted.
            at = s.position + (self._accepted.get(v.live_slot, 0) if s.chained and v is not None else 0)
            out.extend((firsts[s.seq] + r, gens[s.seq], position_seed(seed, at + r)) for r in range(si.widths[s.seq]))
        return out

    def _sample(
        self, si: SamplingInputs, x: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator]
    ) -> torch.Tensor:
        best = x.argmax(dim=-1)
        if si.filters is None:
            return best
        probs = torch.softmax(filter_rows(x, si.filters), dim=-1)
        rows = list(range(len(params)))
        drawn = draw(probs, self.generators.shared, self._keyed(si, rows, params, gens, [None] * len(rows)))
        return torch.where(si.filters.greedy, best, drawn)

    def _verify(
        self,
        si: SamplingInputs,
        x: torch.Tensor,
        input_ids: torch.Tensor,
        params: list[SamplingParams],
        gens: list[torch.Generator],
        verify: list[VerifyRows | None],
        drafts: list[list[int]] | None,
        draft_q: Callable[[VerifyRows], torch.Tensor],
    ) -> tuple[list[list[int]], list[int | None]]:
        firsts = [0, *accumulate(si.widths)]
        best = x.argmax(dim=-1)
        probs = None if si.filters is None else torch.softmax(filter_rows(x, si.filters), dim=-1)
        picked = best
        if probs is not None and si.filters is not None:
            drawn = draw(probs, self.generators.shared, self._keyed(si, firsts, params, gens, verify))
            picked = torch.where(si.filters.greedy, best, drawn)
        if drafts is None:  # one read for the picked tokens and the drafts
            rows = _draft_rows(verify)
            rows_t = torch.tensor(rows, dtype=torch.int64, device=x.device)
            both = torch.cat([picked, input_ids[rows_t]]).tolist()
            host, drafts = both[: picked.shape[0]], _split_drafts(both[picked.shape[0] :], verify)
        else:
            host = picked.tolist()
        keyed = {s.seq for s in si.seeded}
        tokens: list[list[int]] = []
        accepted: list[int | None] = []
        for n, v in enumerate(verify):
            lo, hi = firsts[n], firsts[n + 1]
            if v is None:
                tokens.append([host[lo]])
                accepted.append(None)
                continue
            # Seeded rows picked their own draws: a draft stays while it equals the draw at its
            # position, so the tokens are those of sampling without drafts.
            if params[n].is_greedy or probs is None or n in keyed:
                out: Accepted = accept_greedy_ids(host[lo:hi], drafts[n])
            else:
                out = accept_rejection(probs[lo:hi], drafts[n], draft_q(v), gens[n])
            self._accepted[v.live_slot] = out.num_accepted
            tokens.append(out.token_ids)
            accepted.append(out.num_accepted)
        return tokens, accepted

    def _advance(self, si: SamplingInputs, tokens: list[list[int]]) -> None:
        """Count the new tokens in the penalty registers; advance the grammar matchers."""
        p = si.penalties
        if p is not None:
            pairs = [(reg, t) for reg, toks in zip(p.seq_registers, tokens) if reg >= 0 for t in toks]
            if pairs:
                regs = torch.tensor([r for r, _ in pairs], dtype=torch.int64, device=self.device)
                toks = torch.tensor([t for _, t in pairs], dtype=torch.int64, device=self.device)
                self.penalties.add(regs, toks)
        if si.grammar and self.grammars is not None:
            self.grammars.accept(si.grammar, tokens)

    def _logprobs(
        self, si: SamplingInputs, raw: torch.Tensor, tokens: list[list[int]], params: list[SamplingParams]
    ) -> list[list[TokenLogprob | None] | None]:
        if not si.logprob_seqs:
            return [None] * len(tokens)
        out: list[list[TokenLogprob | None] | None] = [[None] * len(t) for t in tokens]
        firsts = [0, *accumulate(si.widths)]
        where = [(n, i) for n in si.logprob_seqs for i in range(len(tokens[n]))]
        rows = torch.tensor([firsts[n] + i for n, i in where], dtype=torch.int64, device=raw.device)
        ids = torch.tensor([tokens[n][i] for n, i in where], dtype=torch.int64, device=raw.device)
        for (n, i), e in zip(where, token_logprobs(raw[rows], ids, si.max_top_logprobs)):
            out[n][i] = TokenLogprob(e.token_id, e.logprob, e.top[: params[n].logprobs or 0])  # type: ignore[index]
        return out


def _draft_rows(verify: list[VerifyRows | None]) -> list[int]:
    return [r for v in verify if v is not None for r in range(v.first_row + 1, v.first_row + 1 + v.num_drafts)]


def _split_drafts(flat: list[int], verify: list[VerifyRows | None]) -> list[list[int]]:
    """Per sampling sequence its drafts, from the drafts of every verify in batch order."""
    out, at = [], 0
    for v in verify:
        k = 0 if v is None else v.num_drafts
        out.append(flat[at : at + k])
        at += k
    return out


def _drafts(input_ids: torch.Tensor, verify: list[VerifyRows | None]) -> list[list[int]]:
    """Each sampling sequence's draft tokens (host lists; empty unless a verify): one read."""
    rows = _draft_rows(verify)
    if not rows:
        return [[] for _ in verify]
    return _split_drafts(input_ids[torch.tensor(rows, dtype=torch.int64, device=input_ids.device)].tolist(), verify)
