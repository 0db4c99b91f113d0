"""Turns a scheduled batch into device tensors, runs the model, samples.

The only place that reads device results: ``StepResult`` comes back as Python lists via a
single ``.tolist()`` per tensor after sampling (the one sync per step).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.device_pools import DevicePools
from workers.forward_batch import ForwardBatch
from workers.request import TokenLogprob
from workers.sampler import GeneratorBank, sample
from workers.checkpoints import StepPlan


@dataclass(frozen=True)
class StepResult:
    """Per sampling sequence of the batch, in batch order."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def build_forward_batch(plan: StepPlan, page_size: int, device: torch.device) -> ForwardBatch:
    batch = plan.batch
    input_ids: list[int] = []
    positions: list[int] = []
    out_loc: list[int] = []
    cu = [0]
    logits_rows: list[int] = []
    dst_slots: list[int] = []
    max_pages = max(len(s.request.page_ids) for s in batch.seqs)
    page_table = [[0] * max_pages for _ in batch.seqs]
    for b, seq in enumerate(batch.seqs):
        req = seq.request
        input_ids.extend(req.token_slice(seq.start, seq.end))
        for pos in range(seq.start, seq.end):
            positions.append(pos)
            out_loc.append(req.page_ids[pos // page_size] * page_size + pos % page_size)
        page_table[b][: len(req.page_ids)] = req.page_ids
        cu.append(cu[-1] + seq.num_new_tokens)
        dst_slots.extend([0] * (seq.num_new_tokens - 1) + [plan.track_slot(b)])
        if seq.samples:
            logits_rows.append(cu[-1] - 1)

    def t(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return ForwardBatch(
        input_ids=t(input_ids, torch.int64),
        positions=t(positions, torch.int64),
        cu_seqlens=t(cu, torch.int32),
        seq_lens=t([s.end for s in batch.seqs], torch.int32),
        out_loc=t(out_loc, torch.int64),
        page_table=t(page_table, torch.int32),
        mamba_slot_ids=t([s.request.mamba_slot for s in batch.seqs], torch.int32),
        has_initial_state=t([s.start > 0 for s in batch.seqs], torch.bool),
        logits_indices=t(logits_rows, torch.int64),
        page_size=page_size,
        state_dst_slots=t(dst_slots, torch.int32) if plan.tracks else None,
    )


class ModelRunner:
    def __init__(self, model: torch.nn.Module, pools: DevicePools, page_size: int,
                 device: torch.device, generators: GeneratorBank) -> None:
        self.model = model
        self.pools = pools
        self.page_size = page_size
        self.device = device
        self.generators = generators

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        batch = plan.batch
        if plan.cow:
            src = torch.tensor([s for s, _ in plan.cow], dtype=torch.int64, device=self.device)
            dst = torch.tensor([d for _, d in plan.cow], dtype=torch.int64, device=self.device)
            self.pools.mamba.copy_slot(src, dst)
        fb = build_forward_batch(plan, self.page_size, self.device)
        hidden = self.model.forward(fb, self.pools)
        sampling = [s for s in batch.seqs if s.samples]
        if not sampling:
            return StepResult([], [])
        logits = self.model.compute_logits(hidden[fb.logits_indices])
        params = [s.request.params for s in sampling]
        gens = [self.generators.get(s.request.request_id, s.request.params.seed) for s in sampling]
        result = sample(logits, params, gens)
        token_ids = result.token_ids.tolist()
        return StepResult(token_ids, _logprob_lists(result, params, token_ids))


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
