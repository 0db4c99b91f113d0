"""``debug.state_oracle_sample``: recompute published checkpoints and compare (I1/I4 on data).

The ledger's labels are checked against what the runner reports writing; this checks the
report itself against the math. A sampled checkpoint's path is prefilled again from the
empty state, in one forward, into a private pair of pools, and every state tensor of the
result is compared with the checkpoint's slot. Mismatches mean the slot does not hold
H(depth) of its path (a runner writing the wrong row, an aliased donation, a kernel bug):
``hybridserve_state_oracle_mismatches_total`` must stay 0.

The slot is read when the checkpoint is published (``pick``, on the scheduler thread): its
content is final then (the batch that wrote it is processed, and no batch in flight may
write a tree-owned slot, I3). The recompute runs later on the forward thread, against that
copy: by then the slot may have been evicted and reused -- by a batch launched after, or
by a host-tier promotion that writes it at once, outside launch order (``workers/tiers``).
"""

from __future__ import annotations

import logging
import random

import torch

from workers.device_pools import DevicePools, build_pools
from workers.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)
RTOL = 1e-3  # chunked vs one-shot prefill differ by rounding; a wrong depth by O(1)


def fresh_prefill_states(
    model: torch.nn.Module, token_ids: list[int], page_size: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """Every recurrent state after ``token_ids``, from the empty state, in one forward."""
    spec = model.cache_spec()
    num_pages = -(-len(token_ids) // page_size)
    pools = build_pools(spec, num_pages + 1, page_size, 2, dtype, device)
    pages = list(range(1, num_pages + 1))
    n = len(token_ids)

    def t(values: list, dt: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dt, device=device)

    fb = ForwardBatch(
        input_ids=t(token_ids, torch.int64),
        positions=t(list(range(n)), torch.int64),
        cu_seqlens=t([0, n], torch.int32),
        seq_lens=t([n], torch.int32),
        out_loc=t([pages[i // page_size] * page_size + i % page_size for i in range(n)], torch.int64),
        page_table=t([pages], torch.int32),
        mamba_slot_ids=t([1], torch.int32),
        has_initial_state=t([False], torch.bool),
        logits_indices=t([n - 1], torch.int64),
        page_size=page_size,
    )
    model.forward(fb, pools)
    return pools.mamba.slot_states(1)


def state_errors(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> list[tuple[float, float]]:
    return [
        (round(float((g.float() - w.float()).abs().max()), 6), round(float(w.float().abs().max()), 6))
        for g, w in zip(got, want)
    ]


def states_match(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> bool:
    return all(
        g.shape == w.shape and float((g.float() - w.float()).abs().max()) <= RTOL * (1.0 + float(w.float().abs().max()))
        for g, w in zip(got, want)
    )


class StateOracle:
    """Samples published checkpoints; ``check`` runs one on the forward thread -> match?"""

    def __init__(
        self,
        model: torch.nn.Module,
        pools: DevicePools,
        page_size: int,
        device: torch.device,
        dtype: torch.dtype,
        sample: float,
        seed: int,
    ) -> None:
        self.model, self.pools, self.page_size = model, pools, page_size
        self.device, self.dtype = device, dtype
        self.sample = sample
        self.rng = random.Random(seed)

    @torch.inference_mode()
    def pick(self, published: list[tuple[int, list[int]]]) -> list[tuple[tuple[torch.Tensor, ...], list[int]]]:
        """The sampled checkpoints, each with a copy of its slot's state taken now."""
        picked = [
            (tuple(t.clone() for t in self.pools.mamba.slot_states(slot)), tokens)
            for slot, tokens in published
            if self.rng.random() < self.sample
        ]
        if picked and self.device.type == "cuda":
            # copied before a copy stream reuses the slot
            torch.cuda.current_stream(self.device).synchronize()
        return picked

    @torch.inference_mode()
    def check(self, held: tuple[torch.Tensor, ...], token_ids: list[int]) -> bool:
        want = fresh_prefill_states(self.model, token_ids, self.page_size, self.device, self.dtype)
        ok = states_match(held, want)
        if not ok:
            logger.warning(
                "state oracle mismatch at depth %d: %s (max |got - want|, max |want| per state)",
                len(token_ids),
                state_errors(held, want),
            )
        return ok
