"""Ranks 1..N-1 of a TP group: a model shard and pool shard that run rank 0's steps.

``TPWorker`` is a plain class; a launcher runs it in its own process (a Ray actor in
``cluster/``, a spawned process for the offline API). It joins the group, loads the
checkpoint and shards it exactly as rank 0 does, receives rank 0's ``PoolLayout`` and
builds its pools and MTP drafter with those sizes, then ``run()`` executes every
``StepMessage`` with ``ModelRunner._execute`` (the same code path as rank 0) until
``Stop``. Any error aborts the group so that rank 0 fails at once, and is re-raised.
Waiting for rank 0's next message (the layout, each step, ``Stop``) is the one wait
without the group's bound (``idle``, see ``workers.tp.comm``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from configs.schema import HybridServeConfig
from workers.device_pools import build_pools
from workers.engine import resolve_device, resolve_dtype
from workers.loader import load_model, load_tokenizer
from workers.model_runner import ModelRunner, StepResult
from workers.sampling.grammar import GrammarCompiler
from workers.sampling.sampler import GeneratorBank
from workers.spec.setup import build_drafter
from workers.state_spec import ATTENTION
from workers.tp.comm import Rendezvous, TPGroup
from workers.tp.messages import PoolLayout, StepMessage, Stop, map_tensors
from workers.tp.runner import check_consistent
from workers.tp.shard import shard_model, shard_module

logger = logging.getLogger(__name__)


class TPWorker:
    def __init__(
        self, config: HybridServeConfig, rank: int, rendezvous: Rendezvous, num_threads: int | None = None
    ) -> None:
        if num_threads:
            torch.set_num_threads(num_threads)  # as rank 0: CPU results depend on it
        self.device = resolve_device(config.device)
        self.group = TPGroup(rendezvous, rank, self.device)
        try:
            self._build(config)
        except BaseException as exc:
            self.group.abort(f"rank {rank} failed while starting: {exc!r}")
            raise

    def _build(self, config: HybridServeConfig) -> None:
        torch.manual_seed(config.seed)
        model = load_model(config.model_dir(), resolve_dtype(config.dtype, self.device), self.device).model
        shard_model(model, self.group)
        layout: PoolLayout = self.group.broadcast_object(idle=True)  # rank 0 builds meanwhile
        spec = model.cache_spec().with_layers(ATTENTION, layout.num_kv_layers)  # + the MTP head's
        pools = build_pools(
            spec, layout.num_pages, layout.page_size, layout.num_mamba_slots, getattr(torch, layout.dtype), self.device
        )
        drafter = None
        if layout.mtp_kv_index is not None:
            drafter = build_drafter(config, model, pools, layout.mtp_kv_index, layout.max_model_len, self.device)
            assert drafter is not None
            shard_module(drafter.mtp, self.group)
        self.generators = GeneratorBank(config.seed, self.device)
        model_dir = config.model_dir()
        # Each rank compiles the grammars its matchers need (on first use, cached).
        grammars = GrammarCompiler(lambda: load_tokenizer(model_dir), int(model.lm_head_weight().shape[0]))
        self.runner = ModelRunner(
            model,
            pools,
            layout.page_size,
            self.device,
            self.generators,
            overlap=False,
            scratch_base=layout.scratch_base,
            drafter=drafter,
            grammar_compiler=grammars,
        )
        self.check_consistency = config.debug.check_invariants
        self.num_steps = 0

    @property
    def rank(self) -> int:
        return self.group.rank

    def run(self) -> int:
        """Execute rank 0's steps until ``Stop`` (``serve_steps``); returns the number run."""
        serve_steps(self.group, self.step)
        return self.num_steps

    def step(self, msg: StepMessage) -> StepResult:
        for handle in msg.dropped:
            self.generators.drop(handle)
        prepared = map_tensors(msg.prepared, lambda t: t.to(self.device))
        gens = [self.generators.get(handle, seed) for handle, seed in msg.generator_keys]
        result = self.runner._execute(prepared, list(msg.params), gens)
        if self.check_consistency:
            check_consistent(self.group, result, self.runner.drafter, self.num_steps)
        self.num_steps += 1
        return result


def serve_steps(group: TPGroup, step: Callable[[StepMessage], object]) -> int:
    """Ranks 1..N-1: run each of rank 0's step messages until ``Stop``; returns how many ran.

    A message is waited for idle (``IDLE_TIMEOUT``: the engine may idle for days); what
    a step waits for inside is bounded by the group's timeout. An error aborts the group,
    so that rank 0 fails at once rather than at its timeout, and is re-raised.
    """
    num_steps = 0
    try:
        while not isinstance(msg := group.broadcast_object(idle=True), Stop):
            step(msg)
            num_steps += 1
        return num_steps
    except BaseException as exc:
        logger.exception("tensor-parallel rank %d failed after %d steps", group.rank, num_steps)
        group.abort(f"rank {group.rank} failed after {num_steps} steps: {exc!r}")
        raise
