"""The single-process engine: schedule -> launch -> process, one step at a time.

The engine owns the pools, the scheduler and the model runner of one TP group. It takes
token ids (tokenization happens at the edge) and returns token-id deltas
(``EngineOutput``) per step; text is the front-end's (``workers.output_processor``).
Bad input raises ValueError naming the values; nothing is allocated for a rejected
request.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import torch

from configs.schema import HybridServeConfig
from workers.cache import CacheEvent, Violation
from workers.cache.manager import CacheManager
from workers.compiled import build_compiled
from workers.device_pools import build_pools
from workers.engine_outputs import EngineOutputs
from workers.engine_store import StoreEndpoints
from workers.forward_thread import StepFuture
from workers.host_memory import retain_freed_memory
from workers.loader import LoadedModel, load_model, load_tokenizer
from workers.model_runner import ModelRunner, StepResult
from workers.outputs import EngineOutput
from workers.request import FinishReason, Request
from workers.sampling.grammar import GrammarCompiler, GrammarWaitlist
from workers.sampling.params import SamplingParams
from workers.sampling.requests import request_sampling
from workers.sampling.sampler import GeneratorBank
from workers.sampling.validate import check_output_prefix, check_params, check_prompt
from workers.scheduler import Scheduler, pages_needed
from workers.sizing import describe_pools, device_budget, plan_pools
from workers.spec.setup import build_drafter, num_draft_tokens, num_mtp_kv_layers
from workers.state_oracle import StateOracle
from workers.state_spec import ATTENTION
from workers.stats import EngineStats
from workers.step_failure import LaunchedStep, StepFailed, recover_failed_step
from workers.tiers.host_pools import HostPools
from workers.tiers.payload import model_fingerprint
from workers.tiers.storage import TensorTierStorage

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


class Engine(StoreEndpoints):
    supports_tensor_parallel = False  # the TP engine (workers/tp) overrides the hooks

    def __init__(self, config: HybridServeConfig, tokenizer=None) -> None:
        if config.parallel.tensor_parallel_size > 1 and not self.supports_tensor_parallel:
            raise ValueError(
                f"parallel.tensor_parallel_size={config.parallel.tensor_parallel_size} needs the "
                "TP engine: use workers.LLM, workers.tp.build_local_engine or the cluster"
            )
        if config.parallel.tensor_parallel_size > 1 and config.debug.state_oracle_sample > 0:
            raise ValueError(
                f"debug.state_oracle_sample={config.debug.state_oracle_sample} needs "
                f"parallel.tensor_parallel_size=1, got {config.parallel.tensor_parallel_size}"
            )
        self.config = config
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            retain_freed_memory()  # forwards off the main thread (workers/host_memory.py)
        self.dtype = resolve_dtype(config.dtype, self.device)
        model_dir = Path(config.model_dir())
        if not (model_dir / "config.json").exists():
            raise ValueError(f"model directory {str(model_dir)!r} has no config.json")
        torch.manual_seed(config.seed)
        loaded = self._load_model(model_dir)
        self.model, self.hf_config = loaded.model, loaded.hf_config
        self.tokenizer = tokenizer or load_tokenizer(model_dir)
        self.eos_token_id = self._find_eos()
        # The logits' width: token ids past it (a padded head's spare rows) are refused.
        self.vocab_size = int(self.model.lm_head_weight().shape[0])
        self.stats = EngineStats()
        self._build_pools()
        self.generators = GeneratorBank(config.seed, self.device)
        self.lag = 1 if config.scheduler.overlap else 0
        self.grammar_compiler = GrammarCompiler(lambda: self.tokenizer, self.vocab_size)
        self.grammar_wait = GrammarWaitlist(self.grammar_compiler)
        self.runner = self._build_runner()
        self._attach_tiers()
        self.outputs = EngineOutputs(
            self.stats,
            self.max_model_len,
            release=self.scheduler.release,
            on_finish=lambda r: self.runner.drop_request(r),
        )
        self._launched: deque[LaunchedStep] = deque()  # launched, not yet fully processed
        self.oracle = (
            StateOracle(
                self.model,
                self.pools,
                config.cache.page_size,
                self.device,
                self.dtype,
                config.debug.state_oracle_sample,
                config.seed,
            )
            if config.debug.state_oracle_sample > 0
            else None
        )
        self._oracle_checks: list[StepFuture[bool]] = []
        self._next_handle = 1
        self._gauge_steps = 0
        self.num_overlapped_launches = 0
        self.raise_on_violation = False  # tests turn this on: violations raise, not just count

    def _load_model(self, model_dir: Path) -> LoadedModel:
        """Hook: load the checkpoint (a TP engine shards it here, before the pools)."""
        return load_model(model_dir, self.dtype, self.device, self.config.fp8_weights)

    def _build_runner(self) -> ModelRunner:
        """Hook: the model runner (a TP engine's also ships each step to the other ranks)."""
        return ModelRunner(
            self.model,
            self.pools,
            self.config.cache.page_size,
            self.device,
            self.generators,
            overlap=self.lag > 0,
            scratch_base=self.slot_ledger.num_slots,
            drafter=self.drafter,
            grammar_compiler=self.grammar_compiler,
            compiled=build_compiled(self.config, self.model, self.pools, self.device, self.max_model_len, self.drafter),
            max_pages=self.max_pages_per_request(),
            deterministic=self.config.deterministic,
        )

    def max_pages_per_request(self) -> int:
        """Pages a running request may hold: its context, a verify past it and the drafts."""
        k = num_draft_tokens(self.config.spec)
        return pages_needed(self.max_model_len + 2 * (k + 1), self.config.cache.page_size) + 1

    def _attach_tiers(self) -> None:
        """The host tier's storage: host pools mirroring the device pools (pinned on a GPU).
        On a GPU copies run on a copy stream, promotions asynchronously; on a CPU they run on
        the scheduler thread at once (their destinations are fresh, their sources locked,
        so the forward running beside them touches neither)."""
        host = self.cache.host
        self.fingerprint = ""
        if host is None:
            return
        pools = HostPools.mirror(self.pools, host.pages.size, host.ledger.num_slots)
        host.storage = TensorTierStorage(self.pools, pools)
        self.fingerprint = model_fingerprint(self.config.model_dir(), self.dtype)

    def _find_eos(self) -> int | None:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None:
            eos = getattr(self.hf_config, "eos_token_id", None)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return eos

    def _build_pools(self) -> None:
        spec = self.model.cache_spec()
        k = num_draft_tokens(self.config.spec)
        max_pos = int(getattr(self.hf_config, "max_position_embeddings", 1 << 20))
        page_size = self.config.cache.page_size
        # Speculation: a KV layer per attention block of the MTP head and k + 1 scratch slots per
        # running request for the per-draft states of a verify (never in the ledger).
        num_scratch = (k + 1) * self.config.scheduler.max_running_requests if k else 0
        num_target_kv = spec.num_layers(ATTENTION)
        mtp_layers = num_mtp_kv_layers(self.config.spec, self.model)
        pool_spec = spec.with_layers(ATTENTION, num_target_kv + mtp_layers) if num_target_kv else spec
        budget = device_budget(self.config.cache, self.device)
        sizes = plan_pools(self.config, pool_spec, max_pos, self.dtype, budget, num_scratch)
        logger.info("%s", describe_pools(sizes, page_size, num_scratch, budget))
        self.pool_sizes = sizes
        self.max_model_len = sizes.max_model_len
        self.pools = build_pools(
            pool_spec, sizes.num_pages, page_size, sizes.num_slots + num_scratch, self.dtype, self.device
        )
        self.cache = CacheManager(
            self.config.cache, self.config.debug, sizes.num_pages, sizes.num_slots, self.stats, seed=self.config.seed
        )
        self.page_allocator = self.cache.pages
        self.slot_ledger = self.cache.ledger
        self.scheduler = Scheduler(self.config.scheduler, self.cache, self.max_model_len, k)
        self.drafter = build_drafter(
            self.config, self.model, self.pools, num_target_kv, self.max_model_len, self.device
        )

    # -- requests ------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, output_prefix: Sequence[int] = ()
    ) -> None:
        """``output_prefix``: output tokens generated elsewhere (a prefill/decode hand-off),
        the request's first outputs as if it had sampled them: ``max_tokens``, penalties,
        the grammar and seeded draws count them; only what follows is output."""
        self._validate(request_id, prompt_token_ids)
        check_params(params, self.vocab_size)
        prefix = list(output_prefix)
        if prefix:
            check_output_prefix(
                len(prompt_token_ids), prefix, params, self.vocab_size, self.max_model_len, self.eos_token_id
            )
        req = Request(
            request_id,
            list(prompt_token_ids),
            params,
            arrival_time=time.monotonic(),
            handle=self._next_handle,
            eos_token_id=self.eos_token_id,
            sampling=request_sampling(params, self.eos_token_id, self.tokenizer),
            output_token_ids=prefix,
            num_resumed_outputs=len(prefix),
        )
        self._next_handle += 1
        self.outputs.add(req)
        if not self.grammar_wait.hold(req):  # a grammar still compiling: admitted later
            self.scheduler.add(req)

    def _admit_compiled(self) -> list[EngineOutput]:
        ready, failed = self.grammar_wait.take_ready()
        for req in ready:
            self.scheduler.add(req)
        outputs = []
        for req, exc in failed:
            logger.error(
                "request %s: its grammar %s did not compile: %s",
                req.request_id,
                req.params.structured_output.describe(),
                exc,
            )
            self.outputs.finish(req, FinishReason.ABORT)
            outputs.append(self.outputs.output(req, [], None))
        return outputs

    @property
    def requests(self) -> dict[str, Request]:
        return self.outputs.requests

    def _validate(self, request_id: str, prompt: list[int]) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        check_prompt(prompt, self.vocab_size, self.max_model_len)

    def abort(self, request_id: str) -> EngineOutput | None:
        return self._end(request_id, FinishReason.ABORT)

    def stop(self, request_id: str) -> EngineOutput | None:
        """The front-end matched a stop string: end the request as a normal finish (its
        checkpoints are published; the tokens it ran past the string are its own path)."""
        return self._end(request_id, FinishReason.STOP)

    def _end(self, request_id: str, reason: FinishReason) -> EngineOutput | None:
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        self.outputs.finish(req, reason)
        return self.outputs.output(req, [], None)

    def has_unfinished(self) -> bool:
        return (
            self.scheduler.has_work()
            or bool(self._launched)
            or bool(self._oracle_checks)
            or len(self.grammar_wait) > 0
            or self.cache.has_transfers()
        )

    # -- the step --------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        """Schedule and launch the next batch, then process the oldest unprocessed one.

        With ``scheduler.overlap`` the batch launched here runs on the forward thread while
        the previous batch's result is processed (a lag of one step); without it the same
        code processes the batch it just launched (lag zero).

        A step that raises ends the requests of every batch it had launched and not yet
        processed (every running request when it failed before forming a batch): they
        finish with ``abort``, their slots and pages return, and the engine goes on. The
        error is re-raised as ``StepFailed`` carrying their final outputs (an interrupt
        as itself, after the same clean-up).
        """
        outputs = self._admit_compiled() if len(self.grammar_wait) else []
        try:
            outputs += self._advance()
        except BaseException as exc:
            failed = recover_failed_step(self, self._launched)
            if not isinstance(exc, Exception):
                raise
            raise StepFailed(exc, outputs + failed) from exc
        self._update_gauges()
        if self.oracle is not None:
            self._run_oracle(wait=not self._launched)
        if self.config.debug.check_invariants:
            self._check_invariants()
        return outputs

    def _advance(self) -> list[EngineOutput]:
        self.cache.poll_transfers()
        outputs: list[EngineOutput] = []
        had_previous = bool(self._launched)
        launched = self._launch_next()
        if launched is None and not had_previous and self.scheduler.has_work():
            if not self.cache.has_transfers():
                raise RuntimeError(self._stuck_message())
            self.cache.poll_transfers(wait=True)  # only copies in flight: wait for the oldest
        if launched is not None and had_previous:  # N+1 launched before N's result is processed
            self.num_overlapped_launches += 1
            self.stats.inc("hybridserve_overlapped_steps_total")
        keep = self.lag if launched is not None else 0
        while len(self._launched) > keep:  # oldest first; the lag leaves one in flight
            outputs += self._process(self._launched[0])
            self._launched.popleft()
        return outputs

    def _run_oracle(self, wait: bool) -> None:
        """Queue checks of newly published checkpoints; count the finished ones."""
        oracle = self.oracle
        assert oracle is not None
        for held, tokens in oracle.pick(self.cache.drain_published()):
            self._oracle_checks.append(self.runner.submit(partial(oracle.check, held, tokens)))
        pending = []
        for future in self._oracle_checks:
            if wait or future.done():
                self.stats.inc("hybridserve_state_oracle_checks_total")
                if not future.result():
                    self.stats.inc("hybridserve_state_oracle_mismatches_total")
            else:
                pending.append(future)
        self._oracle_checks = pending

    def _launch_next(self) -> LaunchedStep | None:
        """Schedule, plan and launch a batch; registered in ``_launched`` as soon as it exists
        (a failure part-way is then cleaned up with it)."""
        batch = self.scheduler.schedule()
        if batch is None:
            return None
        step = LaunchedStep(batch)
        self._launched.append(step)
        step.plan = self.cache.plan_step(batch)
        self.scheduler.on_launch(batch)
        step.future = self.runner.launch(step.plan)
        return step

    def _process(self, step: LaunchedStep) -> list[EngineOutput]:
        batch, plan = step.batch, step.plan
        assert plan is not None and step.future is not None
        result: StepResult = step.future.result()
        self.runner.wait_started()  # overlap: the next step's forward first (ModelRunner.wait_started)
        self.stats.observe("hybridserve_step_duration_seconds", result.forward_seconds)
        self.stats.inc("hybridserve_forward_tokens_total", batch.num_tokens)
        self.stats.inc("hybridserve_engine_steps_total", label="compiled" if result.compiled else "eager")
        if result.recompiles:
            self.stats.inc("hybridserve_compile_recompiles_total", result.recompiles)
        if result.gap_seconds is not None:
            self.stats.observe("hybridserve_step_gap_seconds", result.gap_seconds)
        self.stats.inc("hybridserve_preemptions_total", len(batch.preempted))
        sampled = [i for i, seq in enumerate(batch.seqs) if seq.samples]
        rows_committed = {i: a + 1 for i, a in zip(sampled, result.num_accepted) if a is not None}
        self.cache.complete_step(batch, plan, result.writes)
        step.completed = True
        self.scheduler.on_complete(batch, rows_committed)
        for b, first, entries in result.prompt_logprobs:  # before the outputs that carry them
            self.outputs.add_prompt_logprobs(batch.seqs[b].request, first, entries)
        outputs = []
        drafted = accepted = generated = 0
        for n, i in enumerate(sampled):
            seq, req = batch.seqs[i], batch.seqs[i].request
            if seq.is_verify:
                drafted += seq.num_draft_tokens
                accepted += rows_committed[i] - 1
            if not req.is_finished:  # finished while this batch was in flight: discard
                out = self.outputs.append(req, result.token_ids[n], result.logprobs[n])
                generated += len(out.new_token_ids)
                outputs.append(out)
        self.stats.inc("hybridserve_generation_tokens_total", generated)
        if drafted:
            self.stats.inc("hybridserve_spec_draft_tokens_total", drafted)
            self.stats.inc("hybridserve_spec_accepted_tokens_total", accepted)
        for seq in batch.seqs:
            if not seq.request.prompt_counted:  # once per request, cache hit or not
                seq.request.prompt_counted = True
                self.stats.inc("hybridserve_prompt_tokens_total", seq.request.num_prompt_tokens)
        self.cache.donate_unfinished(batch)
        return outputs

    def _stuck_message(self) -> str:
        """Nothing in flight and nothing schedulable with work left: a liveness bug (a
        request that fits the pools alone always finishes), reported instead of a hang."""
        s = self.scheduler
        running = [(r.request_id, r.num_computed_tokens, len(r.page_ids)) for r in s.running]
        return (
            f"engine made no progress: {len(s.running)} running, {len(s.waiting)} waiting, "
            f"pools {self.pool_counts()}, running {running}"
        )

    def _check_invariants(self) -> None:
        violations = self.check_invariants()
        self.stats.inc("hybridserve_invariant_checks_total")
        for v in violations:
            self.stats.inc("hybridserve_invariant_violations_total", label=v.invariant)
        if violations and self.raise_on_violation:
            raise AssertionError(
                "invariant violations: " + "; ".join(f"{v.invariant}: {v.message}" for v in violations)
            )

    def check_invariants(self) -> list[Violation]:
        return self.cache.check_invariants(self.scheduler.running)

    # -- cache control ---------------------------------------------------------------------
    def flush_cache(self) -> int:
        """Empty the prefix cache (what running requests lock stays). Returns checkpoints freed."""
        return self.cache.flush()

    def record_cache_events(self) -> None:
        """Keep checkpoint events for ``drain_cache_events`` (off by default: unread, they
        would grow with every checkpoint the engine ever inserts or evicts)."""
        self.cache.record_events()

    def drain_cache_events(self) -> list[CacheEvent]:
        return self.cache.drain_events()

    def check_workers(self) -> None:
        """Raise when the engine can no longer step (the replica's health check). One
        process: nothing beside this thread to check (``TPEngine`` checks its ranks)."""
