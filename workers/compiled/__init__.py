"""Compiled steps: shape-static decode and verify steps and the greedy MTP draft
chain per batch-size bucket, and the persistent compile cache. ``build_compiled`` is what the
engine calls."""

from __future__ import annotations

import math
from typing import Any

import torch

from configs.schema import HybridServeConfig
from workers.compiled.cache import configure_cache
from workers.compiled.draft_chain import CompiledChain
from workers.compiled.progress import CompileProgress
from workers.compiled.steps import Bucket, CompiledSteps
from workers.device_pools import DevicePools

__all__ = ["Bucket", "CompiledChain", "CompiledSteps", "build_compiled"]


def build_compiled(
    config: HybridServeConfig,
    model: torch.nn.Module,
    pools: DevicePools,
    device: torch.device,
    max_model_len: int,
    drafter: Any | None,
) -> CompiledSteps | None:
    """The compiled steps of ``config.compile`` (decode, and verify of 1 + k rows with a
    drafter, whose ``compiled_chain`` this sets), every bucket compiled before this returns,
    a line per bucket on stderr (``CompileProgress``); None when ``compile.enabled`` is off.
    (A tensor-parallel engine builds its runners without this: its ranks run eager.)"""
    if not config.compile.enabled or config.deterministic:  # the batch-invariant mode runs eager
        return None
    page_size = config.cache.page_size
    max_pages = math.ceil(max_model_len / page_size)
    k = drafter.k if drafter is not None else 0
    steps = CompiledSteps(
        model,
        pools,
        config.compile,
        device,
        max_pages=max_pages,
        page_size=page_size,
        verify_lens=(k + 1,) if k else (),
    )
    num_warm_ups = len(steps.buckets) + (2 * len(config.compile.batch_sizes) if drafter is not None else 0)
    progress = CompileProgress(
        num_warm_ups, f"compiling the steps of {config.model}", configure_cache(config.compile.cache_dir)
    )
    steps.warm_up(progress)
    if drafter is not None:
        chain = CompiledChain(
            drafter.mtp, model, pools, config.compile, device, k, page_size, max_model_len, max_pages, drafter.vocab
        )
        chain.warm_up(int(model.model.embedding.weight.shape[1]), model.dtype, progress)
        drafter.compiled_chain = chain
    steps.compile_times = progress.finish()
    return steps
