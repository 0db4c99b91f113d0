"""MiniMax's lightning attention mixer (``self_attn`` of its ``linear_attention`` layers).

``qkv = silu(qkv_proj(x))`` laid out per head as [q | k | v] (head_dim each); the linear
attention of ``kernels.lightning`` with the per-head decay rate ``slope`` (state [H, D, D]
fp32 per slot, no conv); an RMSNorm over all H x D channels (eps 1e-6: transformers builds it
without the config's eps); times ``sigmoid(output_gate(x))``; ``out_proj``.

The slope of head h in layer l of L is ``base ** (h + 1) * (1 - l / (L - 1 + 1e-5) + 1e-5)``
with ``base = 2 ** (-8 / H)``, computed as transformers does (fp32). transformers saves it and
its blocked-prefill tables (``slope_rate``, ``query_decay``, ``key_decay``,
``diagonal_decay``) as buffers. A checkpoint that carries ``slope_rate`` has it used as saved;
its tables are checked against that slope and ``block_size`` (``check_loaded_tables``) and
then dropped: transformers' prefill reads the tables and its decode the slope, so tables that
disagree would make the checkpoint's own math inconsistent, and are refused, named.

Under TP the heads shard; the norm over all heads then sums its squares over the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels import dense
from kernels.lightning import lightning_attention
from workers.models.layers import LayerContext, RMSNorm, activation, linear
from workers.models.weights import WeightTarget, whole
from workers.state_spec import StateKind, StateRef, lightning_kind

NORM_EPS = 1e-6
TABLES = ("query_decay", "key_decay", "diagonal_decay")


@dataclass(frozen=True)
class LightningDims:
    hidden_size: int
    num_heads: int
    head_dim: int
    layer_idx: int
    num_layers: int
    block_size: int  # only to check the saved tables; not math
    act: str = "silu"


def slope_rates(num_heads: int, layer_idx: int, num_layers: int) -> torch.Tensor:
    """[H] fp32, transformers' ``get_slope_rate`` (same ops, same order)."""
    base = 1 / (2 ** (8 / num_heads))
    exponent = torch.arange(num_heads) + 1
    factor = 1 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5
    return (base**exponent) * factor


def decay_tables(slope: torch.Tensor, block_size: int) -> dict[str, torch.Tensor]:
    """transformers' ``decay_factors`` of slope [H, 1, 1]: the blocked prefill's tables."""
    pos = torch.arange(block_size, device=slope.device) + 1
    diagonal = slope * (pos[:, None] - pos[None, :])[None, None]
    return {
        "query_decay": torch.exp(-slope * pos[:, None]),
        "key_decay": torch.exp(-slope * (block_size - pos[:, None])),
        "diagonal_decay": torch.exp(torch.where(diagonal >= 0, -diagonal, float("-inf"))),
    }


class LightningAttention(nn.Module):
    def __init__(self, dims: LightningDims, dtype: torch.dtype) -> None:
        super().__init__()
        self.dims = dims
        width = dims.num_heads * dims.head_dim
        self.act = activation(dims.act)
        self.qkv_proj = linear(dims.hidden_size, 3 * width, False, dtype)
        self.output_gate = linear(dims.hidden_size, width, False, dtype)
        self.out_proj = linear(width, dims.hidden_size, False, dtype)
        self.norm: nn.Module = RMSNorm(width, NORM_EPS, dtype)
        self.register_buffer("slope", torch.empty(dims.num_heads), persistent=False)
        self._loaded: dict[str, torch.Tensor] = {}

    def init_slope(self) -> None:
        """Fill ``slope`` from the formula (after the model is allocated on its device)."""
        d = self.dims
        self.slope.copy_(slope_rates(d.num_heads, d.layer_idx, d.num_layers))

    def state_kind(self) -> StateKind:
        return lightning_kind(self.dims.num_heads, self.dims.head_dim)

    def forward(self, x: torch.Tensor, ctx: LayerContext, ref: StateRef) -> torch.Tensor:
        d, batch = self.dims, ctx.batch
        num_tokens = x.shape[0]
        qkv = self.act(self.qkv_proj(x)).view(num_tokens, d.num_heads, 3 * d.head_dim)
        q, k, v = qkv.split(d.head_dim, dim=-1)
        states = ctx.pools.mamba.layer(ref)["ssm"]
        o = lightning_attention(q, k, v, self.slope, states, batch.recurrent)
        o = self.norm(o.reshape(num_tokens, -1))
        return self.out_proj(dense.pointwise(torch.sigmoid, self.output_gate(x)) * o)  # row-invariant gate

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        """Parameters under their names; the saved buffers optional (see the module doc)."""
        targets = {prefix + n: whole(p) for n, p in self.named_parameters()}
        h, bs = self.dims.num_heads, self.dims.block_size
        targets[prefix + "slope_rate"] = whole(self.slope.view(h, 1, 1), required=False)
        shapes = {"query_decay": (h, bs, 1), "key_decay": (h, bs, 1), "diagonal_decay": (1, h, bs, bs)}
        for name, shape in shapes.items():
            self._loaded[name] = torch.full(shape, float("nan"), device=self.slope.device)
            targets[prefix + name] = whole(self._loaded[name], required=False)
        return targets

    def check_loaded_tables(self, where: str) -> None:
        """Refuse saved decay tables that disagree with the slope; then drop them."""
        loaded, self._loaded = self._loaded, {}
        if self.slope.is_meta:  # a model built for its shapes only
            return
        want = decay_tables(self.slope.float().view(-1, 1, 1), self.dims.block_size)
        for name, table in loaded.items():
            if bool(torch.isnan(table).all()):
                continue  # not in the checkpoint
            if not torch.allclose(table.float(), want[name], rtol=1e-5, atol=1e-6):
                diff = float((table.float() - want[name]).abs().max())
                raise ValueError(
                    f"{where}{name} disagrees with {where}slope_rate and block_size="
                    f"{self.dims.block_size} (max abs diff {diff:.3g}): transformers' "
                    "prefill and decode would compute different attention"
                )
