"""What rank 0 sends to the other ranks of its TP group.

Once, after building: ``PoolLayout`` (the pool sizes and ids rank 0 allocated, so every
rank's shard is addressed by the same page and slot ids). Then per step a
``StepMessage``: the ``PreparedStep`` whose plan is replaced by a ``PlanView`` -- the
frozen fields the runner's forward thread reads, copied on the scheduler thread at launch
(Requests hold tree nodes and must not travel) -- plus what makes sampling identical on
every rank: the sampling params, the generator key of each sampling row, and the request
handles whose generators rank 0 dropped since the last step. ``Stop`` ends a worker's loop.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from workers.cache.checkpoints import StepPlan
from workers.sampling.params import SamplingParams
from workers.scheduler_types import SeqSpan
from workers.step_inputs import PreparedStep


@dataclass(frozen=True)
class PoolLayout:
    num_pages: int  # KV pages, including the dummy page 0
    page_size: int
    num_kv_layers: int  # attention layers in the KV pool: the target's (+ 1 per MTP layer)
    num_mamba_slots: int  # ledger slots + verify scratch slots, including slot 0
    scratch_base: int
    max_model_len: int
    mtp_kv_index: int | None  # the MTP head's first KV layer; None without speculation
    dtype: str  # torch dtype name of rank 0's pools (tensors whose spec names none)


@dataclass(frozen=True)
class RequestView:
    request_id: str
    handle: int
    mamba_slot: int | None
    page_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class SeqView(SeqSpan):
    request: RequestView
    start: int
    num_new_tokens: int
    samples: bool
    num_draft_tokens: int
    max_shift: int


@dataclass(frozen=True)
class BatchView:
    batch_id: int
    seqs: tuple[SeqView, ...]


@dataclass(frozen=True)
class PlanView:
    batch: BatchView
    cow: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class StepMessage:
    prepared: PreparedStep  # plan: PlanView; tensors on the CPU
    params: tuple[SamplingParams, ...]
    generator_keys: tuple[tuple[int, int | None], ...]  # (request handle, seed) per sampling row
    dropped: tuple[int, ...]


@dataclass(frozen=True)
class Stop:
    pass


def plan_view(plan: StepPlan) -> PlanView:
    seqs = tuple(
        SeqView(
            RequestView(
                s.request.request_id, s.request.handle, s.request.mamba_slot, list(s.request.page_ids), s.request.params
            ),
            s.start,
            s.num_new_tokens,
            s.samples,
            s.num_draft_tokens,
            s.max_shift,
        )
        for s in plan.batch.seqs
    )
    return PlanView(BatchView(plan.batch.batch_id, seqs), tuple(plan.cow))


def map_tensors(obj: Any, fn: Any) -> Any:
    """A copy of a (nested) frozen dataclass with ``fn`` applied to every tensor field (fields
    derived in ``__post_init__`` are derived anew)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if hasattr(obj, "__dataclass_fields__") and not isinstance(obj, type):
        changes = {
            f.name: map_tensors(getattr(obj, f.name), fn)
            for f in fields(obj)
            if f.init
            and (
                isinstance(getattr(obj, f.name), torch.Tensor) or hasattr(getattr(obj, f.name), "__dataclass_fields__")
            )
        }
        return replace(obj, **changes) if changes else obj
    return obj
