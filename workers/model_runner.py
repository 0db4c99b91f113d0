"""Turns a step plan into device tensors, runs the model, samples.

``launch`` prepares a batch on the calling (scheduler) thread and runs it either at once
(lag 0) or on the forward thread (``overlap``): one worker, so batches run in launch
order and batch N+1 sees everything batch N wrote. A token that is still being sampled
by the batch before (the overlap lag) enters the next batch as a placeholder row that
the forward thread fills from the ``last_token`` register of the request's live slot, the
way a GPU overlap scheduler reads a future-token buffer. Results come back as Python
lists: the forward thread reads its sampled tokens once per step (the one sync).
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from workers.checkpoints import StepPlan
from workers.device_pools import DevicePools
from workers.forward_batch import ForwardBatch
from workers.request import TokenLogprob
from workers.sampler import GeneratorBank, sample


@dataclass(frozen=True)
class StepResult:
    """Per sampling sequence of the batch, in batch order."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    forward_seconds: float = 0.0
    gap_seconds: float | None = None     # forward thread idle before this step


@dataclass(frozen=True)
class PreparedStep:
    plan: StepPlan
    fb: ForwardBatch
    future_rows: torch.Tensor | None     # rows whose input token is sampled by the batch before
    future_slots: torch.Tensor | None    # the live slots holding those tokens' registers
    sample_slots: torch.Tensor           # live slot of every sampling row (register targets)


def prepare_step(plan: StepPlan, page_size: int, device: torch.device) -> PreparedStep:
    batch = plan.batch
    input_ids: list[int] = []
    positions: list[int] = []
    out_loc: list[int] = []
    dst_slots: list[int] = []
    future_rows: list[int] = []
    future_slots: list[int] = []
    cu = [0]
    logits_rows: list[int] = []
    max_pages = max(len(s.request.page_ids) for s in batch.seqs)
    page_table = [[0] * max_pages for _ in batch.seqs]
    for b, seq in enumerate(batch.seqs):
        req = seq.request
        known = req.num_tokens
        for pos in range(seq.start, seq.end):
            if pos < known:
                input_ids.append(req.token_at(pos))
            else:                                     # sampled by the in-flight batch
                future_rows.append(len(input_ids))
                future_slots.append(req.mamba_slot)
                input_ids.append(0)
            positions.append(pos)
            out_loc.append(req.page_ids[pos // page_size] * page_size + pos % page_size)
        page_table[b][: len(req.page_ids)] = req.page_ids
        cu.append(cu[-1] + seq.num_new_tokens)
        dst_slots.extend([0] * (seq.num_new_tokens - 1) + [plan.track_slot(b)])
        if seq.samples:
            logits_rows.append(cu[-1] - 1)

    def t(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    fb = ForwardBatch(
        input_ids=t(input_ids, torch.int64), positions=t(positions, torch.int64),
        cu_seqlens=t(cu, torch.int32), seq_lens=t([s.end for s in batch.seqs], torch.int32),
        out_loc=t(out_loc, torch.int64), page_table=t(page_table, torch.int32),
        mamba_slot_ids=t([s.request.mamba_slot for s in batch.seqs], torch.int32),
        has_initial_state=t([s.start > 0 for s in batch.seqs], torch.bool),
        logits_indices=t(logits_rows, torch.int64), page_size=page_size,
        state_dst_slots=t(dst_slots, torch.int32) if plan.tracks else None)
    return PreparedStep(plan, fb, t(future_rows, torch.int64) if future_rows else None,
                        t(future_slots, torch.int64) if future_slots else None,
                        t([s.request.mamba_slot for s in batch.seqs if s.samples], torch.int64))


class ModelRunner:
    def __init__(self, model: torch.nn.Module, pools: DevicePools, page_size: int,
                 device: torch.device, generators: GeneratorBank, overlap: bool) -> None:
        self.model = model
        self.pools = pools
        self.page_size = page_size
        self.device = device
        self.generators = generators
        self.last_token = torch.zeros(pools.mamba.num_slots, dtype=torch.int64, device=device)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="hybridserve-forward") if overlap else None
        self._last_end: float | None = None

    def launch(self, plan: StepPlan) -> Future[StepResult]:
        prepared = prepare_step(plan, self.page_size, self.device)
        sampling = [s for s in plan.batch.seqs if s.samples]
        params = [s.request.params for s in sampling]
        gens = [self.generators.get(s.request.request_id, s.request.params.seed) for s in sampling]
        if self._executor is not None:
            return self._executor.submit(self._execute, prepared, params, gens)
        done: Future[StepResult] = Future()
        done.set_result(self._execute(prepared, params, gens))
        return done

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    @torch.inference_mode()
    def _execute(self, prepared: PreparedStep, params, gens) -> StepResult:
        start = time.monotonic()
        gap = None if self._last_end is None else start - self._last_end
        plan, fb = prepared.plan, prepared.fb
        if prepared.future_rows is not None:
            fb.input_ids[prepared.future_rows] = self.last_token[prepared.future_slots]
        if plan.cow:
            src = torch.tensor([s for s, _ in plan.cow], dtype=torch.int64, device=self.device)
            dst = torch.tensor([d for _, d in plan.cow], dtype=torch.int64, device=self.device)
            self.pools.mamba.copy_slot(src, dst)
        hidden = self.model.forward(fb, self.pools)
        token_ids: list[int] = []
        logprobs: list[TokenLogprob | None] = []
        if params:
            logits = self.model.compute_logits(hidden[fb.logits_indices])
            result = sample(logits, params, gens)
            self.last_token[prepared.sample_slots] = result.token_ids
            token_ids = result.token_ids.tolist()
            logprobs = _logprob_lists(result, params, token_ids)
        self._last_end = time.monotonic()
        return StepResult(token_ids, logprobs, self._last_end - start, gap)


def _logprob_lists(result, params, token_ids: list[int]) -> list[TokenLogprob | None]:
    if result.logprobs is None:
        return [None] * len(token_ids)
    chosen = result.logprobs.tolist()
    top_ids = result.top_ids.tolist()
    top_lps = result.top_logprobs.tolist()
    out: list[TokenLogprob | None] = []
    for i, p in enumerate(params):
        if p.logprobs is None:
            out.append(None)
            continue
        top = list(zip(top_ids[i][: p.logprobs], top_lps[i][: p.logprobs]))
        out.append(TokenLogprob(token_ids[i], chosen[i], top))
    return out
