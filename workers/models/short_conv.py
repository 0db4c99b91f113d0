"""The gated short convolution of LFM2, LFM2-MoE and Lfm3 (``conv``).

Per token: ``in_proj`` splits as ``[B | C | x]`` (hidden each); ``B * x`` goes through a
depthwise causal conv of width ``conv_L_cache`` without activation (``kernels.conv1d``, its
state in the slot pool: the last W-1 *gated* inputs ``B * x``, oldest first); the output is
gated again by ``C`` and goes through ``out_proj``. The one state is that conv window:
``StateKind`` ``short_conv`` [hidden, W-1], no scan state. ``conv_bias`` gives all three
(``in_proj``, ``conv``, ``out_proj``) a bias, as transformers does.

Under TP (``workers/tp/shard_layers.py``) the hidden channels split: every op is per channel
between ``in_proj`` (column) and ``out_proj`` (row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from workers.models.layers import CausalConv1d, LayerContext, linear
from workers.state_spec import StateKind, StateRef, short_conv_kind


@dataclass(frozen=True)
class ShortConvDims:
    hidden_size: int
    channels: int  # conv channels (= hidden_size; a TP rank's share after sharding)
    conv_kernel: int  # W (conv_L_cache)
    bias: bool  # conv_bias

    def validate(self) -> None:
        if self.conv_kernel < 2:
            raise ValueError(f"conv_L_cache={self.conv_kernel} must be at least 2")


class ShortConv(nn.Module):
    def __init__(self, dims: ShortConvDims, dtype: torch.dtype) -> None:
        super().__init__()
        dims.validate()
        self.dims = dims
        self.in_proj = linear(dims.hidden_size, 3 * dims.channels, dims.bias, dtype)
        self.conv = CausalConv1d(dims.channels, dims.conv_kernel, dims.bias, dtype, activation=None)
        self.out_proj = linear(dims.channels, dims.hidden_size, dims.bias, dtype)

    def state_kind(self) -> StateKind:
        return short_conv_kind(self.dims.channels, self.dims.conv_kernel)

    def forward(self, hidden: torch.Tensor, ctx: LayerContext, ref: StateRef) -> torch.Tensor:
        b, c, x = self.in_proj(hidden).chunk(3, dim=-1)
        y = self.conv(b * x, ctx.pools.mamba.layer(ref)["conv"], ctx.batch)
        return self.out_proj(c * y)
