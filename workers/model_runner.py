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
from dataclasses import dataclass, replace
from functools import partial
from typing import TypeVar

import torch

from kernels import dense
from workers.cache.checkpoints import StepPlan
from workers.compiled import Bucket, CompiledSteps
from workers.device_pools import DevicePools
from workers.forward_thread import ForwardThread, Signal, StepFuture
from workers.input_batch import InputBatch
from workers.request import Request, TokenLogprob
from workers.sampling.build import SamplingPlanner
from workers.sampling.decide import BatchSampler
from workers.sampling.grammar import GrammarCompiler
from workers.sampling.inputs import SamplingInputs
from workers.sampling.logprobs import prompt_logprobs
from workers.sampling.params import SamplingParams
from workers.sampling.sampler import GeneratorBank
from workers.scheduler_types import StateWrite
from workers.spec.drafter import MtpDrafter, MtpSpan
from workers.step_inputs import PreparedStep, VerifyRows, prepare_step, resolve_chained
from workers.uniform_inputs import await_uploads, prepare_uniform, uniform_rows

T = TypeVar("T")


@dataclass(frozen=True)
class StepResult:
    """Per sampling sequence of the batch, in batch order."""

    token_ids: list[list[int]]  # 1 token, or accepted drafts + 1 for a verify
    logprobs: list[list[TokenLogprob | None]]
    num_accepted: list[int | None]  # drafts accepted (verify rows only)
    writes: tuple[StateWrite, ...] = ()  # every ledger slot this step wrote, with its depth
    forward_seconds: float = 0.0
    gap_seconds: float | None = None  # forward thread idle before this step
    # Per sequence that asked for prompt logprobs: (batch index, first prompt position, entries).
    prompt_logprobs: tuple[tuple[int, int, list[TokenLogprob]], ...] = ()
    compiled: bool = False  # the forward ran a compiled step (else eager)
    recompiles: int = 0  # graphs compiled in this step after the warm-up


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        pools: DevicePools,
        page_size: int,
        device: torch.device,
        generators: GeneratorBank,
        overlap: bool,
        scratch_base: int,
        drafter: MtpDrafter | None = None,
        grammar_compiler: GrammarCompiler | None = None,
        compiled: CompiledSteps | None = None,
        max_pages: int = 0,
        deterministic: bool = False,
    ) -> None:
        self.model, self.pools, self.page_size, self.device = model, pools, page_size, device
        if deterministic:
            if not model.batch_invariant:
                name = type(model).__name__
                raise ValueError(f"deterministic is not supported for {name} (no batch-invariant kernels)")
            dense.check_invariant_mode(device, {p.dtype for p in model.parameters() if p.is_floating_point()})
        self.deterministic = deterministic  # every step in kernels.dense's batch-invariant mode
        self.generators = generators
        self.planner = SamplingPlanner()  # host side (scheduler thread)
        self.sampler = BatchSampler(device, generators, grammar_compiler)  # forward thread
        self.scratch_base = scratch_base
        self.drafter = drafter
        self.compiled = compiled
        # The persistent page-table rows of the steady state's vectorized inputs (0: none).
        self.inputs = InputBatch(max_pages) if max_pages else None
        self.last_token = torch.zeros(pools.mamba.num_slots, dtype=torch.int64, device=device)
        # Drafts the last verify of each live slot accepted: where a chained verify starts.
        self.accepted = torch.zeros(pools.mamba.num_slots, dtype=torch.int64, device=device)
        self.accepted_host = [0] * pools.mamba.num_slots
        self._recompiles = 0  # compiled calls' recompiles counted so far
        self._executor = ForwardThread("hybridserve-forward") if overlap else None
        self._last_end: float | None = None
        self._latest_started: Signal | None = None  # scheduler thread: the last launch's
        self._starting: Signal | None = None  # forward thread: the running step's

    def launch(self, plan: StepPlan) -> StepFuture[StepResult]:
        prepared = self._prepare(plan, self.planner.build(plan.batch.seqs))
        sampling = [s for s in plan.batch.seqs if s.samples]
        params = [s.request.params for s in sampling]
        gens = [self.generators.get(s.request.handle, s.request.params.seed) for s in sampling]
        run = self._bind(prepared, params, gens)
        if self._executor is not None:
            started = self._latest_started = Signal()
            return self._executor.submit(partial(self._signalled, run, started))
        done: StepFuture[StepResult] = StepFuture()
        done.set_result(run())
        return done

    def _prepare(self, plan: StepPlan, sampling: SamplingInputs | None = None) -> PreparedStep:
        """A step's inputs: vectorized over the persistent rows when the batch is uniform
        (every sequence a decode, or every one a verify), else row by row."""
        rows = uniform_rows(plan.batch) if self.inputs is not None else 0
        if rows:
            assert self.inputs is not None
            return prepare_uniform(plan, self.inputs, rows, self.page_size, self.device, self.scratch_base, sampling)
        return replace(prepare_step(plan, self.page_size, self.device, self.scratch_base), sampling=sampling)

    def _signalled(self, run: Callable[[], StepResult], started: Signal) -> StepResult:
        """Forward thread: ``run`` with ``started`` set once its forward is entered (or it fails)."""
        self._starting = started
        try:
            return run()
        finally:
            started.set()
            self._starting = None

    def wait_started(self) -> None:
        """Scheduler thread, overlap: return once the last launched step has entered its
        forward. The host work that follows (processing the step before, scheduling the next)
        then runs while the forward runs without the GIL (a compiled step) instead of holding
        the GIL the forward thread needs to get there: on a CPU that start-up (filling
        placeholders, padding, the compiled call's guards) otherwise waits for the whole of
        the host work, about a millisecond a step."""
        if self._latest_started is not None:
            self._latest_started.wait()

    def _bind(self, prepared: PreparedStep, params: list[SamplingParams], gens) -> Callable[[], StepResult]:
        """Hook: one step's work, bound on the scheduler thread (TP also ships it to the other ranks)."""
        return partial(self._execute, prepared, params, gens)

    def submit(self, fn: Callable[[], T]) -> StepFuture[T]:
        """Run ``fn`` on the forward thread after every step launched so far (at once
        without overlap): debug work that reads the pools, such as the state oracle."""
        if self._executor is not None:
            return self._executor.submit(fn)
        done: StepFuture[T] = StepFuture()
        done.set_result(fn())
        return done

    def drop_request(self, req: Request) -> None:
        """A request finished (host thread): its generator, registers and matcher go."""
        self.generators.drop(req.handle)
        self.planner.drop(req)
        if self.inputs is not None:
            self.inputs.drop(req.handle)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown()

    # -- the forward thread ------------------------------------------------------------------
    @torch.inference_mode()
    def _execute(self, prepared: PreparedStep, params: list[SamplingParams], gens) -> StepResult:
        with dense.batch_invariant(self.deterministic):
            return self._execute_step(prepared, params, gens)

    def _execute_step(self, prepared: PreparedStep, params: list[SamplingParams], gens) -> StepResult:
        start = time.monotonic()
        gap = None if self._last_end is None else start - self._last_end
        await_uploads(prepared.uploads)
        self._fill_placeholders(prepared)
        prepared = resolve_chained(prepared, self.accepted, self.accepted_host)
        plan, fb = prepared.plan, prepared.fb
        if plan.cow:
            self.pools.mamba.copy_slots([s for s, _ in plan.cow], [d for _, d in plan.cow])
        bucket = self.compiled.pick(fb) if self.compiled is not None else None
        hidden, all_logits = self._forward(fb, bucket)
        if prepared.copy_src is not None:  # snapshots of a decode batch (step_inputs)
            assert prepared.copy_dst is not None
            self.pools.mamba.copy_slot(prepared.copy_src, prepared.copy_dst)
        si = prepared.sampling.on(self.device) if prepared.sampling is not None else None
        if si is not None:
            self.sampler.begin(si)
        tokens: list[list[int]] = []
        logprobs: list[list[TokenLogprob | None]] = []
        accepted: list[int | None] = []
        writes = list(prepared.writes)
        if params:
            assert si is not None
            rows = None if prepared.logits_all_rows else fb.logits_indices
            if all_logits is None:
                logits = self.model.compute_logits(hidden if rows is None else hidden[rows])
            else:
                logits = all_logits if rows is None else all_logits[rows]
            tokens, logprobs, accepted, last = self._decide(prepared, si, logits, params, gens, writes)
            self._set_last_tokens(prepared, tokens, last)
        prompt = ()
        if si is not None and si.prompt is not None:
            prompt = tuple(prompt_logprobs(si.prompt, hidden, self.model.compute_logits))
        if self.drafter is not None and not self._draft_verified(prepared, hidden, tokens, params):
            self.drafter.run(self._mtp_spans(prepared, hidden, tokens, accepted, params, gens))
        self._last_end = time.monotonic()
        return StepResult(
            tokens,
            logprobs,
            accepted,
            tuple(writes),
            self._last_end - start,
            gap,
            prompt,
            compiled=bucket is not None,
            recompiles=self._new_recompiles(),
        )

    def _new_recompiles(self) -> int:
        chain = self.drafter.compiled_chain if self.drafter is not None else None
        total = (self.compiled.num_recompiles if self.compiled is not None else 0) + (
            chain.num_recompiles if chain is not None else 0
        )
        new, self._recompiles = total - self._recompiles, total
        return new

    def _forward(self, fb, bucket: Bucket | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden [T, H], logits of every row or None): the compiled step of ``bucket``
        (``CompiledSteps.pick``), eager where none fits."""
        if bucket is None:
            self._mark_started()
            return self.model.forward(fb, self.pools), None
        assert self.compiled is not None
        return self.compiled.run(fb, bucket, on_enter=self._mark_started)

    def _mark_started(self) -> None:
        if self._starting is not None:
            self._starting.set()

    def _fill_placeholders(self, prepared: PreparedStep) -> None:
        ids = prepared.fb.input_ids
        if prepared.future_rows is not None:
            ids[prepared.future_rows] = self.last_token[prepared.future_slots]
        if prepared.draft_rows is not None:
            assert self.drafter is not None
            ids[prepared.draft_rows] = self.drafter.draft_tokens[prepared.draft_slots, prepared.draft_index]

    def _decide(
        self,
        prepared: PreparedStep,
        si: SamplingInputs,
        logits: torch.Tensor,
        params: list[SamplingParams],
        gens: list[torch.Generator],
        writes: list[StateWrite],
    ):
        """Sample each sampling sequence, or verify its drafts; commit verified states (and
        append what the commits wrote to ``writes``)."""
        by_seq = {v.seq_index: v for v in prepared.verify}
        sampling = [i for i, s in enumerate(prepared.plan.batch.seqs) if s.samples]
        verify = [by_seq.get(i) for i in sampling]
        decision = self.sampler.decide(si, prepared.fb.input_ids, logits, params, gens, verify, self._draft_q)
        sources: list[int] = []
        destinations: list[int] = []
        slots, counts = [], []
        for v, n in zip(verify, decision.num_accepted):
            if v is not None and n is not None:
                src, dst, committed = v.commit(n, prepared.starts[v.seq_index])
                sources += src
                destinations += dst
                writes.extend(committed)
                slots.append(v.live_slot)
                counts.append(n)
                self.accepted_host[v.live_slot] = n
        if sources:
            self.pools.mamba.copy_slots(sources, destinations)
        if slots:
            self.accepted[torch.tensor(slots, device=self.device)] = torch.tensor(counts, device=self.device)
        return decision.token_ids, decision.logprobs, decision.num_accepted, decision.last_ids

    def _set_last_tokens(self, prepared: PreparedStep, tokens: list[list[int]], last: torch.Tensor | None) -> None:
        """Each sampling sequence's last token into its live slot's register (the next step's
        placeholder): from the device when the step's sampled tokens are still there."""
        if last is not None and prepared.sample_slots is not None:
            self.last_token[prepared.sample_slots] = last
            return
        slots = [prepared.live_slots[i] for i, s in enumerate(prepared.plan.batch.seqs) if s.samples]
        self.last_token[torch.tensor(slots, device=self.device)] = torch.tensor(
            [t[-1] for t in tokens], device=self.device
        )

    def _draft_q(self, v: VerifyRows) -> torch.Tensor:
        """The distributions the drafts of a sampled verify were drawn from."""
        assert self.drafter is not None and self.drafter.draft_probs is not None
        return self.drafter.draft_probs[v.live_slot, : v.num_drafts]

    def _draft_verified(
        self, prepared: PreparedStep, hidden: torch.Tensor, tokens: list[list[int]], params: list[SamplingParams]
    ) -> bool:
        """A greedy verify batch (every sequence 1 + k rows): the head's catch-up and its k
        drafts in one compiled call (``CompiledChain.run_verified``); False: the eager drafter."""
        drafter, fb = self.drafter, prepared.fb
        assert drafter is not None
        chain = drafter.compiled_chain
        if (
            chain is None
            or drafter.num_layers != 1
            or fb.verify_len != drafter.k + 1
            or len(params) != fb.num_seqs
            or not all(p.is_greedy for p in params)
        ):
            return False
        size = chain.pick(fb.num_seqs, greedy=True, width=int(fb.page_table.shape[1]))
        if size is None:
            return False
        drafts = chain.run_verified(hidden, tokens, list(prepared.starts), fb.page_table, size)
        drafter.draft_tokens[torch.tensor(prepared.live_slots, device=self.device)] = drafts
        return True

    def _mtp_spans(self, prepared: PreparedStep, hidden: torch.Tensor, tokens, accepted, params, gens):
        """The drafter's rows per sequence, from host data only (no read back): a sampling
        sequence continues with the tokens it produced (a verify's accepted drafts are its
        rows 1..a, so its next ids are exactly ``tokens[n]``), a chunk with its known rows."""
        seqs, cu = prepared.plan.batch.seqs, prepared.cu_seqlens
        spans, n = [], 0
        for b, seq in enumerate(seqs):
            first, width = cu[b], cu[b + 1] - cu[b]
            p = g = None
            if seq.samples:
                p, g, out = params[n], gens[n], tokens[n]
                if accepted[n] is not None:
                    width, nxt = accepted[n] + 1, list(out)
                else:
                    nxt = self._known_ids(prepared, first + 1, first + width) + [out[-1]]
                n += 1
            else:
                nxt = self._known_ids(prepared, first + 1, first + width) + [prepared.next_tokens[b]]
            spans.append(
                MtpSpan(
                    prepared.starts[b],
                    hidden[first : first + width],
                    torch.tensor(nxt, device=self.device),
                    list(prepared.page_ids[b]),
                    prepared.live_slots[b],
                    seq.request.request_id,
                    p,
                    g,
                )
            )
        return spans

    @staticmethod
    def _known_ids(prepared: PreparedStep, lo: int, hi: int) -> list[int]:
        """Row ids ``lo:hi`` from the host copy; a placeholder among them (a row whose token
        the batch before sampled: rare outside decode rows) is read from the device."""
        part = list(prepared.row_ids[lo:hi])
        return prepared.fb.input_ids[lo:hi].tolist() if -1 in part else part
