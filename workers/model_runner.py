"""Runs prepared steps: the target forward, sampling or verification, MTP drafting.

``launch`` prepares a batch on the calling (scheduler) thread and runs it either at once
(lag 0) or on the forward thread (``overlap``): one worker, so batches run in launch
order and batch N+1 sees everything batch N wrote. A token still being sampled by the
batch before enters the next batch as a placeholder row that the forward thread fills
from the ``last_token`` register of the request's live slot (a GPU overlap scheduler's
future-token buffer); drafts come from the drafter's registers the same way.

Results come back as Python lists, read once per step on the forward thread. A verify
also reads its acceptance there to commit the state after the last accepted token (and a
grid-crossing state) from the scratch snapshots into the live / track slots.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import torch

from workers.checkpoints import StepPlan
from workers.device_pools import DevicePools
from workers.request import TokenLogprob
from workers.sampler import GeneratorBank, _filter_top_k_top_p, sample
from workers.sampling_params import SamplingParams
from workers.scheduler_types import StateWrite
from workers.spec.acceptance import Accepted, accept_greedy, accept_rejection
from workers.spec.drafter import MtpDrafter, MtpSpan
from workers.step_inputs import PreparedStep, VerifyRows, prepare_step


@dataclass(frozen=True)
class StepResult:
    """Per sampling sequence of the batch, in batch order."""

    token_ids: list[list[int]]                 # 1 token, or accepted drafts + 1 for a verify
    logprobs: list[list[TokenLogprob | None]]
    num_accepted: list[int | None]             # drafts accepted (verify rows only)
    writes: tuple[StateWrite, ...] = ()        # every ledger slot this step wrote, with its depth
    forward_seconds: float = 0.0
    gap_seconds: float | None = None           # forward thread idle before this step


class ModelRunner:
    def __init__(self, model: torch.nn.Module, pools: DevicePools, page_size: int,
                 device: torch.device, generators: GeneratorBank, overlap: bool,
                 scratch_base: int, drafter: MtpDrafter | None = None) -> None:
        self.model, self.pools, self.page_size, self.device = model, pools, page_size, device
        self.generators = generators
        self.scratch_base = scratch_base
        self.drafter = drafter
        self.last_token = torch.zeros(pools.mamba.num_slots, dtype=torch.int64, device=device)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="hybridserve-forward") if overlap else None
        self._last_end: float | None = None

    def launch(self, plan: StepPlan) -> Future[StepResult]:
        prepared = prepare_step(plan, self.page_size, self.device, self.scratch_base)
        sampling = [s for s in plan.batch.seqs if s.samples]
        params = [s.request.params for s in sampling]
        gens = [self.generators.get(s.request.handle, s.request.params.seed) for s in sampling]
        run = self._bind(prepared, params, gens)
        if self._executor is not None:
            return self._executor.submit(run)
        done: Future[StepResult] = Future()
        done.set_result(run())
        return done

    def _bind(self, prepared: PreparedStep, params: list[SamplingParams], gens) -> Callable[[], StepResult]:
        """Hook: one step's work, bound on the scheduler thread (TP also ships it to the other ranks)."""
        return partial(self._execute, prepared, params, gens)

    def submit(self, fn: Callable[[], bool]) -> Future[bool]:
        """Run ``fn`` on the forward thread after every step launched so far (at once
        without overlap): debug work that reads the pools, such as the state oracle."""
        if self._executor is not None:
            return self._executor.submit(fn)
        done: Future[bool] = Future()
        done.set_result(fn())
        return done

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    # -- the forward thread ------------------------------------------------------------------
    @torch.inference_mode()
    def _execute(self, prepared: PreparedStep, params: list[SamplingParams], gens) -> StepResult:
        start = time.monotonic()
        gap = None if self._last_end is None else start - self._last_end
        self._fill_placeholders(prepared)
        plan, fb = prepared.plan, prepared.fb
        if plan.cow:
            src = torch.tensor([s for s, _ in plan.cow], dtype=torch.int64, device=self.device)
            dst = torch.tensor([d for _, d in plan.cow], dtype=torch.int64, device=self.device)
            self.pools.mamba.copy_slot(src, dst)
        hidden = self.model.forward(fb, self.pools)
        tokens: list[list[int]] = []
        logprobs: list[list[TokenLogprob | None]] = []
        accepted: list[int | None] = []
        writes = list(prepared.writes)
        if params:
            logits = self.model.compute_logits(hidden[fb.logits_indices])
            tokens, logprobs, accepted = self._decide(prepared, logits, params, gens, writes)
            last = torch.tensor([t[-1] for t in tokens], device=self.device)
            slots = [prepared.live_slots[i] for i, s in enumerate(plan.batch.seqs) if s.samples]
            self.last_token[torch.tensor(slots, device=self.device)] = last
        if self.drafter is not None:
            self.drafter.run(self._mtp_spans(prepared, hidden, tokens, accepted, params, gens))
        self._last_end = time.monotonic()
        return StepResult(tokens, logprobs, accepted, tuple(writes), self._last_end - start, gap)

    def _fill_placeholders(self, prepared: PreparedStep) -> None:
        ids = prepared.fb.input_ids
        if prepared.future_rows is not None:
            ids[prepared.future_rows] = self.last_token[prepared.future_slots]
        if prepared.draft_rows is not None:
            assert self.drafter is not None
            ids[prepared.draft_rows] = self.drafter.draft_tokens[prepared.draft_slots, prepared.draft_index]

    def _decide(self, prepared: PreparedStep, logits: torch.Tensor, params, gens,
                writes: list[StateWrite]):
        """Sample each sampling sequence, or verify its drafts; commit verified states (and
        append what the commits wrote to ``writes``)."""
        if not prepared.verify:
            result = sample(logits, params, gens)
            ids = result.token_ids.tolist()
            lps = _logprob_lists(result, params, ids)
            return [[t] for t in ids], [[lp] for lp in lps], [None] * len(ids)
        verify = {v.seq_index: v for v in prepared.verify}
        tokens, logprobs, accepted, row = [], [], [], 0
        sampling = [i for i, s in enumerate(prepared.plan.batch.seqs) if s.samples]
        for n, seq_index in enumerate(sampling):
            v = verify.get(seq_index)
            width = 1 if v is None else v.num_drafts + 1
            rows = logits[row:row + width]
            row += width
            out = self._verify(v, rows, params[n], gens[n], prepared, writes) if v else self._sample_one(rows, params[n], gens[n])
            tokens.append(out.token_ids)
            accepted.append(out.num_accepted if v else None)
            logprobs.append(_row_logprobs(rows, out.token_ids, params[n]))
        return tokens, logprobs, accepted

    def _sample_one(self, rows: torch.Tensor, p: SamplingParams, gen) -> Accepted:
        return Accepted(0, sample(rows, [p], [gen]).token_ids.tolist())

    def _verify(self, v: VerifyRows, rows: torch.Tensor, p: SamplingParams, gen,
                prepared: PreparedStep, writes: list[StateWrite]) -> Accepted:
        fb = prepared.fb
        drafts = fb.input_ids[v.first_row + 1: v.first_row + 1 + v.num_drafts].tolist()
        if p.is_greedy:
            out = accept_greedy(rows, drafts)
        else:
            probs = torch.softmax(torch.stack([_filter_top_k_top_p(r / p.temperature, p.effective_top_k, p.top_p)
                                               for r in rows]), dim=-1)
            assert self.drafter is not None and self.drafter.draft_probs is not None
            q = self.drafter.draft_probs[v.live_slot, : v.num_drafts]
            out = accept_rejection(probs, drafts, q, gen)
        src, dst, committed = v.commit(out.num_accepted)
        self.pools.mamba.copy_slot(torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device))
        writes.extend(committed)
        return out

    def _mtp_spans(self, prepared: PreparedStep, hidden: torch.Tensor, tokens, accepted, params, gens):
        fb, seqs = prepared.fb, prepared.plan.batch.seqs
        cu = fb.cu_seqlens.tolist()
        spans, n = [], 0
        for b, seq in enumerate(seqs):
            first, width = cu[b], cu[b + 1] - cu[b]
            p = g = None
            if seq.samples:
                p, g, out = params[n], gens[n], tokens[n]
                width = (accepted[n] + 1) if accepted[n] is not None else width
                nxt = fb.input_ids[first + 1: first + width].tolist() + [out[-1]]
                n += 1
            else:
                nxt = fb.input_ids[first + 1: first + width].tolist() + [prepared.next_tokens[b]]
            spans.append(MtpSpan(seq.start, hidden[first:first + width],
                                 torch.tensor(nxt, device=self.device), list(prepared.page_ids[b]),
                                 prepared.live_slots[b], seq.request.request_id, p, g))
        return spans


def _row_logprobs(rows: torch.Tensor, token_ids: list[int], p: SamplingParams) -> list[TokenLogprob | None]:
    if p.logprobs is None:
        return [None] * len(token_ids)
    lps = torch.log_softmax(rows[: len(token_ids)].float(), dim=-1)
    k = max(p.logprobs, 1)
    top = torch.topk(lps, k, dim=-1)
    return [TokenLogprob(t, float(lps[i, t]), list(zip(top.indices[i, : p.logprobs].tolist(),
                                                       top.values[i, : p.logprobs].tolist())))
            for i, t in enumerate(token_ids)]


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
