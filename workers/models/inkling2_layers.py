"""Inkling2's layer pieces: the attention with clipped q / k, per-token sinks, a gated output
and static or dynamic k / v convs; the depth attention over block states (block attention
residuals); the softcapped-SwiGLU MoE.

- ``l2_clip``: each head vector (times a learned ``scale`` [H, D] where given) scaled down to
  ``threshold`` when its L2 norm is larger, in fp32.
- ``DynamicConv`` (full layers' ``k_sconv`` / ``v_sconv``): tap ``lag`` of token t weights
  ``x[t - lag]`` by ``static_w[lag, c] + weight_proj(u_t)[head(c) * W + lag]`` (``u``: the
  projection's own input), then ``(conv + x) / sqrt(2W + 1)``. Its window is the static conv's
  (the last W-1 inputs), so the static part runs as ``kernels.conv1d`` (which advances the
  window, snapshots included; ``static_w`` is loaded as its ``conv1d.weight``, oldest tap
  first) and the per-token part reads the W-1 earlier inputs from the window as it was before
  the step (``past_inputs``, torch, no host read).
- ``Inkling2Attention``: ``q = l2_clip(wq(x_q), qk_clip, q_l2_clip.scale)``, ``r = l2_clip(
  wr(x_q), rel_clip, rel_l2_clip.scale)``, both times Inkling's log scale on full layers;
  ``k = l2_clip(k_sconv(wk(x_k)), qk_clip)``, ``v = rms(v_sconv(wv(x_v)))`` (unweighted); scores
  ``q.k / sqrt(head_dim)`` plus the relative bias, one sink logit ``attn_sink_proj(x_q)`` per
  head (``kernels.attention.relative``); ``wo(o * sigmoid(gate_attn(x_q)))``. Sliding layers
  have static convs and no log scale. x_q = x_k = x_v except in full layers (three depth
  queries) and in later passes of a looped layer.
- ``DepthAttention`` (``attention_input`` / ``mlp_input`` / ``final_input``): per token, a
  softmax over the unweighted-RMS-normed sources (the completed blocks and the current partial
  block) for each learned query (scaled 1 / sqrt(hidden)), averaging the normed sources; fp32.
- ``Inkling2MoE``: sigmoid router (fp32) with a score-correction bias for the choice, the
  chosen scores renormalised times ``route_scale``; experts ``down(softcap(gate, a) *
  sigmoid(gate) * softcap(up, b))`` summed in fp32. No shared experts.

TP: attention by heads (q / r / gate / sink rows, their clip scales, k / v rows, the convs'
channels and the dynamic taps by KV heads, ``wo`` columns); experts by their intermediate dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from kernels import dense
from kernels.recurrent_batch import RecurrentBatch
from kernels.static import tracing
from workers.device_pools import LayerState
from workers.forward_batch import ForwardBatch
from workers.models import layers
from workers.models.inkling_layers import (
    InklingAttentionDims,
    RelativeLogits,
    ResidualConv,
    head_checks,
    head_parts,
    log_scale,
    relative_attention,
)
from workers.models.layers import CausalConv1d, LayerContext, linear, param
from workers.models.moe import MoeDims, SparseMoE
from workers.state_spec import StateKind, StateRef, attention_kind

DEPTH_EPS = 1e-6  # transformers' unweighted norm of the depth attention keeps its default


def l2_clip(x: Tensor, threshold: float, scale: Tensor | None = None) -> Tensor:
    """x [..., H, D] (times ``scale`` [H, D]) with head vectors longer than ``threshold``
    scaled down to it -> fp32."""
    xf = x.float() if scale is None else x.float() * scale.float()
    norm = xf.square().sum(-1, keepdim=True).sqrt()
    return xf * (threshold / (norm + 1e-6)).clamp(max=1.0)


def unit_rms(x: Tensor, eps: float) -> Tensor:
    """RMS norm without a weight over the last dim, in fp32."""
    xf = x.float()
    return xf * dense.pointwise(torch.rsqrt, xf.square().mean(-1, keepdim=True) + eps)


def softcap(x: Tensor, cap: float) -> Tensor:
    return dense.pointwise(torch.tanh, x / cap) * cap


def past_inputs(x: Tensor, conv_states: Tensor, seqs: RecurrentBatch) -> Tensor:
    """The W-1 inputs before each token of ``x`` [T, D], newest first -> [T, W-1, D] fp32, from
    the sequence's own earlier rows or its window ``conv_states`` [S, D, W-1] (zeros without an
    initial state); read before the step's conv advances the window."""
    num_tokens, hist = x.shape[0], conv_states.shape[-1]
    tok = torch.arange(num_tokens, device=x.device)
    cu = seqs.cu_seqlens.long()
    seq = torch.searchsorted(cu[1:], tok, right=True)
    pos = tok - cu[seq]
    init = conv_states[seqs.slot_ids.long()].float()  # [B, D, W-1]; a fresh slot may hold anything
    init = torch.where(seqs.has_initial_state.bool()[:, None, None], init, torch.zeros_like(init))
    table = torch.cat([x.float(), init.transpose(1, 2).reshape(-1, x.shape[1])])
    lags = torch.arange(1, hist + 1, device=x.device)
    from_window = num_tokens + seq[:, None] * hist + hist - (lags - pos[:, None])
    return table[torch.where(pos[:, None] >= lags, tok[:, None] - lags, from_window)]


class DynamicConv(nn.Module):
    """The full layers' k / v conv (see the module docstring): the static taps ``conv1d.weight``
    [C, 1, W] (oldest first, in the model dtype as transformers keeps them), ``weight_proj``
    [KV * W, hidden] (row h * W + lag)."""

    def __init__(self, channels: int, hidden_size: int, num_heads: int, width: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.width = num_heads, width
        self.conv1d = CausalConv1d(channels, width, False, dtype, activation=None)
        self.weight_proj = param(num_heads * width, hidden_size, dtype=dtype)

    def forward(self, x: Tensor, source: Tensor, state: Tensor, batch: ForwardBatch) -> Tensor:
        n, w = x.shape[0], self.width
        taps = torch.cat([x.float()[:, None], past_inputs(x, state, batch.recurrent)], dim=1)  # [T, W, C]
        weight = self.conv1d.weight[:, 0, :].float()
        static = layers.causal_conv1d(x.float(), weight, None, state, batch.recurrent, activation=None)
        dyn = dense.linear(source, self.weight_proj).float().view(n, self.num_heads, 1, w)
        per_token = (taps.view(n, w, self.num_heads, -1).permute(0, 2, 3, 1) * dyn).sum(-1).reshape(n, -1)
        return ((static + per_token + x.float()) / math.sqrt(2 * w + 1)).to(x.dtype)

    def tp_narrow(self, heads: tuple[int, int]) -> None:
        """Keep KV heads ``heads`` (the channels are narrowed with the static conv's)."""
        from workers.tp.shard_layers import _set, _take

        start, stop = heads
        _set(self, "weight_proj", _take(self.weight_proj, 0, [(start * self.width, stop * self.width)]))
        self.num_heads = stop - start


class ClipScale(nn.Module):
    """``*_l2_clip.scale`` [H, D]: the learned per-head scale before a clip."""

    def __init__(self, heads: int, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.scale = param(heads, dim, dtype=dtype)


@dataclass(frozen=True, kw_only=True)
class Inkling2AttentionDims(InklingAttentionDims):
    """Inkling's, plus the L2 clip thresholds of q / k and of the relative states."""

    qk_clip: float
    rel_clip: float


class Inkling2Attention(nn.Module):
    def __init__(self, dims: Inkling2AttentionDims, dtype: torch.dtype) -> None:
        super().__init__()
        d = self.dims = dims
        q_width, kv_width = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
        self.q_proj = linear(d.hidden_size, q_width, False, dtype)
        self.k_proj = linear(d.hidden_size, kv_width, False, dtype)
        self.v_proj = linear(d.hidden_size, kv_width, False, dtype)
        self.r_proj = linear(d.hidden_size, d.num_heads * d.d_rel, False, dtype)
        self.o_proj = linear(q_width, d.hidden_size, False, dtype)
        self.gate_attn = linear(d.hidden_size, q_width, False, dtype)
        self.attn_sink_proj = linear(d.hidden_size, d.num_heads, False, dtype)
        self.q_l2_clip = ClipScale(d.num_heads, d.head_dim, dtype)
        self.rel_l2_clip = ClipScale(d.num_heads, d.d_rel, dtype)
        self.rel_logits_proj = RelativeLogits(d.d_rel, d.rel_extent, dtype)
        self.k_sconv: nn.Module
        self.v_sconv: nn.Module
        if d.window is None:
            self.k_sconv = DynamicConv(kv_width, d.hidden_size, d.num_kv_heads, d.conv_width, dtype)
            self.v_sconv = DynamicConv(kv_width, d.hidden_size, d.num_kv_heads, d.conv_width, dtype)
        else:
            scale = 1.0 / math.sqrt(d.conv_width + 1)
            self.k_sconv, self.v_sconv = (
                ResidualConv(kv_width, d.conv_width, scale),
                ResidualConv(kv_width, d.conv_width, scale),
            )

    @property
    def kv_width(self) -> int:
        return self.dims.num_kv_heads * self.dims.head_dim

    def state_kind(self) -> StateKind:
        return attention_kind(self.dims.num_kv_heads, self.dims.head_dim, name=self.dims.kind)

    def _conv(self, conv: nn.Module, x: Tensor, source: Tensor, state: Tensor, batch: ForwardBatch) -> Tensor:
        return conv(x, source, state, batch) if isinstance(conv, DynamicConv) else conv(x, state, batch)

    def forward(self, xs: tuple[Tensor, Tensor, Tensor], ctx: LayerContext, ref: StateRef, convs: LayerState) -> Tensor:
        """xs = (x_q, x_k, x_v) [T, hidden] each -> [T, hidden]."""
        d, batch = self.dims, ctx.batch
        xq, xk, xv = xs
        n = xq.shape[0]
        q = l2_clip(self.q_proj(xq).view(n, d.num_heads, d.head_dim), d.qk_clip, self.q_l2_clip.scale)
        r = l2_clip(self.r_proj(xq).view(n, d.num_heads, d.d_rel), d.rel_clip, self.rel_l2_clip.scale)
        if d.log_floor is not None:  # full layers
            tau = log_scale(batch.positions, d.log_floor, d.log_alpha)
            q, r = q * tau, r * tau
        k = self._conv(self.k_sconv, self.k_proj(xk), xk, convs["k"], batch).view(n, d.num_kv_heads, d.head_dim)
        v = self._conv(self.v_sconv, self.v_proj(xv), xv, convs["v"], batch).view(n, d.num_kv_heads, d.head_dim)
        qkv = (q.to(xq.dtype), l2_clip(k, d.qk_clip).to(xq.dtype), unit_rms(v, d.eps).to(xq.dtype))
        sinks = self.attn_sink_proj(xq)
        o = relative_attention(ctx, ref, qkv, d.head_dim**-0.5, r, self.rel_logits_proj.proj, d.window, sinks)
        gate = dense.pointwise(torch.sigmoid, self.gate_attn(xq).float())
        return self.o_proj((o.reshape(n, -1).float() * gate).to(xq.dtype))

    def tp_checks(self) -> list[tuple[int, str]]:
        return head_checks(self.dims)

    def tp_shard(self, rank: int, world: int, comm: object) -> None:
        from workers.tp.shard_layers import _set, _take, column, row

        d = self.dims
        heads, kv = head_parts(d, rank, world)
        for proj, width in ((self.q_proj, d.head_dim), (self.gate_attn, d.head_dim), (self.r_proj, d.d_rel)):
            column(proj, [heads.scaled(width)])
        column(self.attn_sink_proj, [heads])
        for clip in (self.q_l2_clip, self.rel_l2_clip):
            _set(clip, "scale", _take(clip.scale, 0, [heads]))
        for proj, conv in ((self.k_proj, self.k_sconv), (self.v_proj, self.v_sconv)):
            column(proj, [kv.scaled(d.head_dim)])
            _set(conv.conv1d, "weight", _take(conv.conv1d.weight, 0, [kv.scaled(d.head_dim)]))
            if isinstance(conv, DynamicConv):
                conv.tp_narrow(kv)
        row(self.o_proj, [heads.scaled(d.head_dim)], rank)
        self.dims = replace(d, num_heads=heads.size, num_kv_heads=kv.size)


class DepthAttention(nn.Module):
    """Block attention residual: ``query`` [hidden] or [Q, hidden] fp32 (see the module docstring)."""

    def __init__(self, hidden_size: int, num_queries: int = 1) -> None:
        super().__init__()
        shape = (hidden_size,) if num_queries == 1 else (num_queries, hidden_size)
        self.query = param(*shape, dtype=torch.float32)

    def forward(self, blocks: list[Tensor], partial: Tensor) -> Tensor:
        return depth_attend(blocks, partial, self.query.view(-1, partial.shape[-1]))


def depth_attend(blocks: list[Tensor], partial: Tensor, queries: Tensor) -> Tensor:
    """blocks: [T, hidden] each, partial [T, hidden], queries [Q, hidden] -> [T, Q, hidden] fp32
    (row-wise products and sums only: a token's bits do not depend on the batch)."""
    sources = unit_rms(torch.stack([*blocks, partial], dim=1), DEPTH_EPS)  # [T, N, hidden]
    num_tokens, num_sources, hidden = sources.shape
    scores = dense.linear(sources.view(-1, hidden), queries.float()).view(num_tokens, num_sources, -1)
    weights = torch.softmax(scores * hidden**-0.5, dim=1)  # [T, N, Q]
    return (weights.transpose(1, 2)[..., None] * sources[:, None]).sum(2)


class Inkling2MoE(SparseMoE):
    """Sigmoid-routed experts with the softcapped SwiGLU (see the module docstring)."""

    def __init__(self, dims: MoeDims, gate_cap: float, up_cap: float, dtype: torch.dtype) -> None:
        super().__init__(dims, dtype)
        self.gate_cap, self.up_cap = gate_cap, up_cap

    def _glu(self, gate: Tensor, up: Tensor) -> Tensor:
        g, u = gate.float(), up.float()
        return (softcap(g, self.gate_cap) * dense.pointwise(torch.sigmoid, g) * softcap(u, self.up_cap)).to(gate.dtype)

    def _expert(self, h: Tensor, up_w: Tensor, gate_w: Tensor | None, down_w: Tensor, spec_in: str, spec_out: str):
        assert gate_w is not None
        inner = self._glu(torch.einsum(spec_in, h, gate_w), torch.einsum(spec_in, h, up_w))
        return torch.einsum(spec_out, inner, down_w)

    def _routed(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        if tracing():
            return self._routed_static(x, weights, ids)
        assert self.w_gate is not None
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        for e in ids.unique().tolist():  # eager: one host read per layer
            tokens, choice = (ids == e).nonzero(as_tuple=True)
            h = x[tokens]
            inner = self._glu(dense.linear(h, self.w_gate[e]), dense.linear(h, self.w_up[e]))
            out[tokens] += dense.linear(inner, self.w_down[e]).float() * weights[tokens, choice, None].float()
        return out.to(x.dtype)
