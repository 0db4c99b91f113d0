"""Per-invocation low-rank adapters on a projection (Zamba2's shared blocks).

A shared block is invoked at several layers; at invocation ``i`` the projections it owns an
adapter for add ``up_i(down_i(x))``. One adapter may feed several projections with the same
input (Zamba2's MLP adapter feeds ``[gate | up]``): its ``up`` is kept as one linear per
output part so that TP narrows each part with the rows of the projection it is added to.

Checkpoint layout (Zamba2's ``*_adapter_list``): ``{i}.0.weight`` [rank, in] is ``down``,
``{i}.1.weight`` [sum(out_sizes), rank] is ``cat(up parts)``; invocations a block does not
own have no tensors (transformers keeps an Identity there that is never called).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from workers.models.weights import WeightTarget, split, whole


class LoraAdapters(nn.Module):
    def __init__(
        self, in_size: int, rank: int, out_sizes: Sequence[int], invocations: Sequence[int], dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.down = nn.ModuleDict({str(i): nn.Linear(in_size, rank, bias=False, dtype=dtype) for i in invocations})
        self.up = nn.ModuleDict(
            {str(i): nn.ModuleList(nn.Linear(rank, n, bias=False, dtype=dtype) for n in out_sizes) for i in invocations}
        )

    def forward(self, x: torch.Tensor, invocation: int) -> list[torch.Tensor]:
        """One addend per output part; KeyError for an invocation this block does not own."""
        key = str(invocation)
        h = self.down[key](x)
        return [up(h) for up in self.up[key]]

    def parts(self, index: int) -> list[nn.Linear]:
        """Output part ``index`` of every invocation (what TP narrows with its projection)."""
        return [ups[index] for ups in self.up.values()]

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        targets: dict[str, WeightTarget] = {}
        for key, down in self.down.items():
            targets[f"{prefix}{key}.0.weight"] = whole(down.weight)
            targets[f"{prefix}{key}.1.weight"] = split(0, *(up.weight for up in self.up[key]))
        return targets
