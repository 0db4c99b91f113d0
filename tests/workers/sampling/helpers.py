"""Bare requests and scheduled sequences for sampling tests (no engine, no model)."""

from __future__ import annotations

import itertools

import torch

from workers.request import Request
from workers.sampling.build import SamplingPlanner
from workers.sampling.decide import BatchSampler
from workers.sampling.grammar import GrammarCompiler
from workers.sampling.inputs import SamplingInputs
from workers.sampling.params import SamplingParams
from workers.sampling.requests import RequestSampling
from workers.sampling.sampler import GeneratorBank
from workers.scheduler_types import ScheduledSeq

CPU = torch.device("cpu")
EOS = 0
_handles = itertools.count(1)


def request(
    rid: str,
    prompt: list[int],
    outputs: list[int],
    params: SamplingParams,
    bad_words_ids: tuple[tuple[int, ...], ...] = (),
) -> Request:
    blocked = tuple(dict.fromkeys([*params.stop_token_ids, *([] if params.ignore_eos else [EOS])]))
    req = Request(
        rid,
        list(prompt),
        params,
        handle=next(_handles),
        eos_token_id=EOS,
        sampling=RequestSampling(blocked if params.min_tokens else (), bad_words_ids),
    )
    req.output_token_ids = list(outputs)
    return req


def decode(req: Request) -> ScheduledSeq:
    """The next decode of ``req``: its last known token in, one token out."""
    return ScheduledSeq(req, req.num_tokens - 1, 1, samples=True)


def verify(req: Request, num_drafts: int) -> ScheduledSeq:
    return ScheduledSeq(req, req.num_tokens - 1, 1 + num_drafts, samples=True, num_draft_tokens=num_drafts)


def step_inputs(seqs: list[ScheduledSeq], drafts: list[list[int]]) -> torch.Tensor:
    """The flat input rows of decode / verify seqs: the last token, then the drafts."""
    ids = []
    for seq, ds in zip(seqs, drafts):
        ids.append(seq.request.token_at(seq.start))
        ids.extend(ds)
    return torch.tensor(ids, dtype=torch.int64)


class Harness:
    """One planner (host) and one sampler (forward side), as the runner holds them."""

    def __init__(self, vocab: int = 64, tokenizer=None, seed: int = 0) -> None:
        self.planner = SamplingPlanner()
        compiler = GrammarCompiler(lambda: tokenizer, vocab) if tokenizer is not None else None
        self.bank = GeneratorBank(seed, CPU)
        self.sampler = BatchSampler(CPU, self.bank, compiler)

    def build(self, seqs: list[ScheduledSeq]) -> SamplingInputs:
        return self.planner.build(tuple(seqs)).on(CPU)

    def process(self, seqs: list[ScheduledSeq], raw: torch.Tensor, drafts: list[list[int]]) -> torch.Tensor:
        si = self.build(seqs)
        self.sampler.begin(si)
        return self.sampler.process(si, raw.clone(), step_inputs(seqs, drafts), drafts)
