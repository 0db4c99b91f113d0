"""The single-process engine: schedule -> launch -> process, one step at a time.

The engine owns the pools, the scheduler and the model runner of one TP group. It takes
token ids (tokenization happens at the edge), and returns ``RequestOutput``s per step.
Bad input raises ValueError naming the values; nothing is allocated for a rejected
request.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from configs.schema import HybridServeConfig
from workers.cache import CacheEvent, Violation
from workers.cache_manager import CacheManager
from workers.detokenizer import IncrementalDetokenizer
from workers.device_pools import DevicePools, KVPool, MambaPool
from workers.loader import load_model
from workers.model_runner import ModelRunner, StepResult
from workers.outputs import RequestOutput
from workers.request import FinishReason, Request, RequestStatus, TokenLogprob
from workers.sampler import GeneratorBank
from workers.sampling_params import SamplingParams
from workers.scheduler import ScheduledBatch, Scheduler
from workers.sizing import plan_pools
from workers.stats import EngineStats


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


class Engine:
    def __init__(self, config: HybridServeConfig, tokenizer=None) -> None:
        from transformers import AutoTokenizer

        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        model_dir = Path(config.model_dir())
        if not (model_dir / "config.json").exists():
            raise ValueError(f"model directory {str(model_dir)!r} has no config.json")
        torch.manual_seed(config.seed)
        loaded = load_model(model_dir, self.dtype, self.device)
        self.model, self.hf_config = loaded.model, loaded.hf_config
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(str(model_dir))
        self.eos_token_id = self._find_eos()
        self.vocab_size = int(self.hf_config.vocab_size)
        self.stats = EngineStats()
        self._build_pools()
        self.generators = GeneratorBank(config.seed, self.device)
        self.runner = ModelRunner(self.model, self.pools, config.cache.page_size,
                                  self.device, self.generators)
        self.requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self.raise_on_violation = False   # tests turn this on: violations raise, not just count
        self._last_step_end: float | None = None

    def _find_eos(self) -> int | None:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None:
            eos = getattr(self.hf_config, "eos_token_id", None)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return eos

    def _build_pools(self) -> None:
        spec = self.model.cache_spec()
        max_pos = int(getattr(self.hf_config, "max_position_embeddings", 1 << 20))
        sizes = plan_pools(self.config, spec, max_pos)
        self.max_model_len = sizes.max_model_len
        page_size = self.config.cache.page_size
        self.pools = DevicePools(
            kv=KVPool(spec, sizes.num_pages, page_size, self.dtype, self.device),
            mamba=MambaPool(spec, sizes.num_slots, self.dtype, torch.float32, self.device))
        self.cache = CacheManager(self.config.cache, self.config.debug, sizes.num_pages,
                                  sizes.num_slots, self.stats, seed=self.config.seed)
        self.page_allocator = self.cache.pages
        self.slot_ledger = self.cache.ledger
        self.scheduler = Scheduler(self.config.scheduler, self.cache, self.max_model_len)

    # -- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        self._validate(request_id, prompt_token_ids)
        req = Request(request_id, list(prompt_token_ids), params, arrival_time=time.monotonic(),
                      eos_token_id=self.eos_token_id)
        self.requests[request_id] = req
        self._detok[request_id] = IncrementalDetokenizer(
            self.tokenizer, params.stop, params.include_stop_str_in_output)
        self.scheduler.add(req)

    def _validate(self, request_id: str, prompt: list[int]) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt:
            raise ValueError("prompt must contain at least one token")
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt)} tokens; the maximum context length is "
                f"{self.max_model_len}, leaving no room to generate")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        self._finish(req, FinishReason.ABORT)
        return self._output(req, [])

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if batch is None:
            assert not self.scheduler.waiting, "waiting requests but nothing could be scheduled"
            return []
        start = time.monotonic()
        if self._last_step_end is not None:
            self.stats.observe("hybridserve_step_gap_seconds", start - self._last_step_end)
        plan = self.cache.plan_step(batch)
        result = self.runner.execute(plan)
        self._last_step_end = time.monotonic()
        self.stats.observe("hybridserve_step_duration_seconds", self._last_step_end - start)
        self.cache.complete_step(batch, plan)
        outputs = self._process(batch, result)
        self.cache.donate_unfinished(batch)
        self._update_gauges()
        if self.config.debug.check_invariants:
            self._check_invariants()
        return outputs

    def _check_invariants(self) -> None:
        violations = self.check_invariants()
        for v in violations:
            self.stats.inc("hybridserve_invariant_violations_total", label=v.invariant)
        if violations and self.raise_on_violation:
            raise AssertionError("invariant violations: " + "; ".join(f"{v.invariant}: {v.message}" for v in violations))

    def check_invariants(self) -> list[Violation]:
        return self.cache.check_invariants(self.scheduler.running)

    # -- cache control ---------------------------------------------------------------------
    def flush_cache(self) -> int:
        """Empty the prefix cache (what running requests lock stays). Returns checkpoints freed."""
        return self.cache.flush()

    def drain_cache_events(self) -> list[CacheEvent]:
        return self.cache.drain_events()

    def pool_counts(self) -> dict[str, int]:
        tree = self.cache.tree
        return {"kv_pages_free": self.page_allocator.num_free,
                "kv_pages_usable": self.page_allocator.num_usable,
                "kv_pages_cached": tree.num_cached_pages if tree else 0,
                "mamba_slots_free": self.slot_ledger.num_free,
                "mamba_slots_usable": self.slot_ledger.num_usable,
                "mamba_slots_cached": self.slot_ledger.num_tree_owned}

    def _process(self, batch: ScheduledBatch, result: StepResult) -> list[RequestOutput]:
        self.stats.inc("hybridserve_preemptions_total", len(batch.preempted))
        sampled = iter(zip(result.token_ids, result.logprobs))
        outputs = []
        for seq in batch.seqs:
            req = seq.request
            if req.is_finished:
                continue
            req.num_computed_tokens = seq.end
            if seq.start == 0 and req.num_preemptions == 0:
                self.stats.inc("hybridserve_prompt_tokens_total", req.num_prompt_tokens)
            if not seq.samples:
                continue
            token_id, logprob = next(sampled)
            self._append_token(req, token_id, logprob)
            outputs.append(self._output(req, [token_id]))
        return outputs

    def _append_token(self, req: Request, token_id: int, logprob: TokenLogprob | None) -> None:
        now = time.monotonic()
        if req.first_token_time is None:
            req.first_token_time = now
            self.stats.observe("hybridserve_time_to_first_token_seconds", now - req.arrival_time)
        req.output_token_ids.append(token_id)
        if logprob is not None:
            req.output_logprobs.append(logprob)
        self.stats.inc("hybridserve_generation_tokens_total")
        stop_str = self._detok[req.request_id].append(token_id)
        reason = self._check_stop(req, token_id, stop_str)
        if reason is not None:
            self._finish(req, reason)

    def _check_stop(self, req: Request, token_id: int, stop_str: str | None) -> FinishReason | None:
        p = req.params
        if req.num_output_tokens >= p.min_tokens:
            if stop_str is not None:
                req.stop_reason = stop_str
                return FinishReason.STOP
            if token_id == req.eos_token_id and not p.ignore_eos:
                return FinishReason.STOP
            if token_id in p.stop_token_ids:
                req.stop_reason = token_id
                return FinishReason.STOP
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, req: Request, reason: FinishReason) -> None:
        self.scheduler.release(req, finished=reason is not FinishReason.ABORT)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.finished_time = time.monotonic()
        self._detok[req.request_id].flush()
        self.generators.drop(req.request_id)
        self.stats.inc("hybridserve_requests_total", label=reason.value)
        self.stats.observe("hybridserve_e2e_request_latency_seconds", req.finished_time - req.arrival_time)
        if req.first_token_time is not None and req.num_output_tokens > 1:
            tpot = (req.finished_time - req.first_token_time) / (req.num_output_tokens - 1)
            self.stats.observe("hybridserve_time_per_output_token_seconds", tpot)

    def _output(self, req: Request, new_ids: list[int]) -> RequestOutput:
        detok = self._detok[req.request_id]
        finished = req.is_finished
        out = RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids), text=detok.text,
            cached_tokens=req.num_cached_tokens, finished=finished,
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            stop_reason=req.stop_reason, new_token_ids=new_ids,
            delta_text=detok.stream_delta(finished),
            logprobs=list(req.output_logprobs) if req.params.logprobs is not None else None)
        if finished:
            self.requests.pop(req.request_id, None)
            self._detok.pop(req.request_id, None)
        return out

    def _update_gauges(self) -> None:
        g = self.stats.gauges
        g["hybridserve_num_running_requests"] = len(self.scheduler.running)
        g["hybridserve_num_waiting_requests"] = len(self.scheduler.waiting)
        g["hybridserve_kv_pool_usage_ratio"] = self.page_allocator.usage_ratio()
        g["hybridserve_mamba_pool_usage_ratio"] = self.slot_ledger.usage_ratio()
