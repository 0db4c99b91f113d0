"""Rank 0's model runner under TP: ship each step to the other ranks, then run it here.

Every rank runs the same ``ModelRunner._execute`` on the same ``PreparedStep`` with its
own model shard and pool shard. The row-parallel all-reduces leave identical hidden
states and logits on every rank, so sampling, verify acceptance, commits into slots and
MTP drafts come out identical too (greedy, or seeded from identical generators), and
every rank writes the same slot ids of its shard. The message is built on the scheduler
thread at launch (the plan's frozen view) and broadcast from the forward thread just
before the local forward, so the ranks see steps in launch order.
"""

from __future__ import annotations

import hashlib
import logging
import pickle
import threading
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch

from workers.model_runner import ModelRunner, StepResult
from workers.sampling.params import SamplingParams
from workers.sampling.sampler import GeneratorBank
from workers.spec.drafter import MtpDrafter
from workers.step_inputs import PreparedStep, prepare_step
from workers.tp.comm import TPGroup
from workers.tp.messages import StepMessage, Stop, plan_view

logger = logging.getLogger(__name__)
_CPU = torch.device("cpu")


class DropRecordingBank(GeneratorBank):
    """A GeneratorBank that remembers dropped request handles for the next step message."""

    def __init__(self, seed: int, device: torch.device) -> None:
        super().__init__(seed, device)
        self._dropped: list[int] = []
        self._lock = threading.Lock()

    def drop(self, handle: int) -> None:
        super().drop(handle)
        with self._lock:
            self._dropped.append(handle)

    def take_dropped(self) -> tuple[int, ...]:
        with self._lock:
            dropped, self._dropped = tuple(self._dropped), []
        return dropped


def step_digest(result: StepResult, drafter: MtpDrafter | None) -> int:
    """A 56-bit digest of one step's decisions on this rank (tokens, acceptance, drafts)."""
    h = hashlib.blake2b(repr((result.token_ids, result.num_accepted)).encode(), digest_size=7)
    if drafter is not None:
        h.update(drafter.draft_tokens.cpu().numpy().tobytes())
    return int.from_bytes(h.digest(), "little")


def check_consistent(group: TPGroup, result: StepResult, drafter: MtpDrafter | None, step: int) -> None:
    group.check_same(step_digest(result, drafter), f"the decisions of step {step}")


class TPModelRunner(ModelRunner):
    """``check_consistency`` (``debug.check_invariants``): after every step all ranks compare
    a digest of their decisions and raise if they differ."""

    def __init__(self, *args, group: TPGroup, check_consistency: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        assert isinstance(self.generators, DropRecordingBank)
        self.group = group
        self.check_consistency = check_consistency
        self.num_steps = 0
        self._stopped = False

    def _bind(self, prepared: PreparedStep, params: list[SamplingParams], gens) -> Callable[[], StepResult]:
        plan = plan_view(prepared.plan)
        view = replace(prepared, plan=plan)
        # The message needs host tensors: on a GPU, build them again from the same plan
        # (host work) rather than copy back (a sync with the forward still running).
        host = (
            view
            if prepared.fb.input_ids.device.type == "cpu"
            else replace(
                prepare_step(prepared.plan, self.page_size, _CPU, self.scratch_base),
                plan=plan,
                sampling=prepared.sampling,
            )
        )  # host tensors already
        keys = tuple((s.request.handle, s.request.params.seed) for s in plan.batch.seqs if s.samples)
        msg = StepMessage(host, tuple(params), keys, self.generators.take_dropped())
        payload = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)

        def run() -> StepResult:
            step = self.num_steps
            try:
                self.group.broadcast_bytes(payload)
                result = self._execute(view, params, gens)  # the same view as every other rank
                if self.check_consistency:
                    check_consistent(self.group, result, self.drafter, step)
            except BaseException as exc:
                # The ranks no longer agree on the next op: close the group, so that the
                # others fail at once and every later step here fails at once, naming this.
                self.group.abort(f"step {step} failed on rank 0: {exc!r}")
                raise
            self.num_steps += 1
            return result

        return run

    def shutdown(self) -> None:
        """Stop the other ranks after every launched step, then the forward thread.
        Bounded: ``Stop`` waits at most the group's timeout for a rank to take it."""
        if not self._stopped:
            self._stopped = True
            stop = pickle.dumps(Stop())
            try:
                if self._executor is not None:
                    self._executor.submit(partial(self._send_stop, stop)).result()
                else:
                    self._send_stop(stop)
            except RuntimeError:  # a rank is gone or stalled: its launcher ends it
                logger.warning("could not send Stop to the tensor-parallel ranks", exc_info=True)
        super().shutdown()

    def _send_stop(self, stop: bytes) -> None:
        try:
            self.group.broadcast_bytes(stop)
        except BaseException as exc:
            self.group.abort(f"Stop failed: {exc!r}")
            raise
