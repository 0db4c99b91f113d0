"""Multi-head latent attention (MLA) of Kimi-Linear and BailingHybrid (``self_attn`` of their
``full_attention`` layers), with the latent cache of ``kernels.mla``.

transformers (DeepSeek-V3's layout): ``q = q_proj(x)`` or ``q_b(norm(q_a(x)))`` per head
[nope | rope]; ``kv_a_proj_with_mqa(x) = [c_raw (R) | k_r (P)]``, ``c = kv_a_layernorm(c_raw)``;
``kv_b_proj(c)`` per head ``[k_nope (nope) | v (V)]``; the key is ``[k_nope | k_r]`` (k_r shared
by every head), scale ``(nope + P)^-1/2``; ``o_proj`` of the heads' outputs.

Here the pool keeps per token only the row ``[c | k_r]`` (``StateKind`` ``mla``, paged), and
``kv_b_proj`` is absorbed: with W_uk [H, nope, R] and W_uv [H, V, R] its two halves, the query
is ``[W_uk^T q_nope | q_r]`` [H, R + P] and the head's output ``W_uv o_lat``, where o_lat [R]
is attention over the latents with values c. The same scores, the same weighted sum,
reassociated: exact up to rounding, and the pool costs R + P values per token and layer.

Positions (``MlaDims.rope``): ``none`` (Kimi-Linear: no positional encoding at all; k_r is
used as it comes) or ``interleaved`` (BailingHybrid: DeepSeek's RoPE on pairs (x0, x1),
(x2, x3) ... of q_r and k_r, written back de-interleaved [evens | odds] as transformers does;
q and k get the same permutation, so the scores are the interleaved rotation's). BailingHybrid
also gates each head's output by ``sigmoid(g_proj(x))``. The q_a / kv_a norms use eps 1e-6
(transformers builds them without the config's eps).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels import dense
from kernels.mla import mla_attention
from workers.models.layers import LayerContext, RMSNorm, RopeTables, linear
from workers.state_spec import StateKind, StateRef, mla_kind

LATENT_NORM_EPS = 1e-6
ROPE_MODES = ("none", "interleaved")


@dataclass(frozen=True)
class MlaDims:
    hidden_size: int
    num_heads: int
    kv_lora_rank: int  # R
    qk_nope_head_dim: int
    qk_rope_head_dim: int  # P
    v_head_dim: int
    q_lora_rank: int | None
    bias: bool  # attention_bias: q_a_proj, kv_a_proj_with_mqa, o_proj
    rope: str  # one of ROPE_MODES
    head_gate: bool = False  # BailingHybrid's g_proj
    norm_eps: float = LATENT_NORM_EPS  # q_a / kv_a norms (GLM-5.3-Flash: rms_norm_eps)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        return self.qk_head_dim**-0.5

    def validate(self) -> None:
        if self.rope not in ROPE_MODES:
            raise ValueError(f"unknown MLA rope mode {self.rope!r}")
        if self.rope == "interleaved" and self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even for RoPE")
        for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")


def rotate_interleaved(x: torch.Tensor, rope: RopeTables) -> torch.Tensor:
    """x [T, h, P]: pairs (2i, 2i + 1) rotated by frequency i -> [evens' | odds'] (transformers'
    ``apply_rotary_pos_emb_interleave``); the tables are [T, P] = cat(freqs, freqs)."""
    half = x.shape[-1] // 2
    cos, sin = rope[0][:, None, :half], rope[1][:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class LatentAttention(nn.Module):
    def __init__(self, dims: MlaDims, dtype: torch.dtype) -> None:
        super().__init__()
        dims.validate()
        self.dims = dims
        h, hidden, r = dims.num_heads, dims.hidden_size, dims.kv_lora_rank
        if dims.q_lora_rank is None:
            self.q_proj = linear(hidden, h * dims.qk_head_dim, False, dtype)
        else:
            self.q_a_proj = linear(hidden, dims.q_lora_rank, dims.bias, dtype)
            self.q_a_layernorm = RMSNorm(dims.q_lora_rank, dims.norm_eps, dtype)
            self.q_b_proj = linear(dims.q_lora_rank, h * dims.qk_head_dim, False, dtype)
        self.kv_a_proj_with_mqa = linear(hidden, r + dims.qk_rope_head_dim, dims.bias, dtype)
        self.kv_a_layernorm = RMSNorm(r, dims.norm_eps, dtype)
        self.kv_b_proj = linear(r, h * (dims.qk_nope_head_dim + dims.v_head_dim), False, dtype)
        self.o_proj = linear(h * dims.v_head_dim, hidden, dims.bias, dtype)
        if dims.head_gate:
            self.g_proj = linear(hidden, h, False, dtype)

    def state_kind(self) -> StateKind:
        return mla_kind(self.dims.kv_lora_rank, self.dims.qk_rope_head_dim)

    def q_residual(self, x: torch.Tensor) -> torch.Tensor:
        """``q_a_layernorm(q_a_proj(x))`` [T, q_lora_rank] (GLM's indexer reads it too)."""
        return self.q_a_layernorm(self.q_a_proj(x))

    def queries(self, x: torch.Tensor, q_resid: torch.Tensor | None = None) -> torch.Tensor:
        if self.dims.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_residual(x) if q_resid is None else q_resid)
        return q.view(x.shape[0], self.dims.num_heads, self.dims.qk_head_dim)

    def absorbed(
        self, x: torch.Tensor, ctx: LayerContext, q_resid: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (the absorbed query [T, H, R + P], the new tokens' latent rows [T, R + P])."""
        d = self.dims
        r, nope = d.kv_lora_rank, d.qk_nope_head_dim
        q_nope, q_rope = self.queries(x, q_resid).split([nope, d.qk_rope_head_dim], dim=-1)
        c, k_rope = self.kv_a_proj_with_mqa(x).split([r, d.qk_rope_head_dim], dim=-1)
        c, k_rope = self.kv_a_layernorm(c), k_rope[:, None, :]
        if d.rope == "interleaved":
            assert ctx.rope is not None, "interleaved RoPE needs the model's rotary tables"
            q_rope, k_rope = rotate_interleaved(q_rope, ctx.rope), rotate_interleaved(k_rope, ctx.rope)
        w_uk = self.kv_b_proj.weight.view(d.num_heads, nope + d.v_head_dim, r)[:, :nope]  # [H, nope, R]
        query = torch.cat([dense.head_products(q_nope, w_uk.transpose(1, 2)), q_rope], dim=-1)
        return query.contiguous(), torch.cat([c, k_rope[:, 0]], dim=-1)

    def project_out(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The latent output o [T, H, R] -> [T, hidden]: W_uv, the head gate, ``o_proj``."""
        d = self.dims
        w_uv = self.kv_b_proj.weight.view(d.num_heads, d.qk_nope_head_dim + d.v_head_dim, -1)[:, d.qk_nope_head_dim :]
        o = dense.head_products(o, w_uv)  # [T, H, V]
        if d.head_gate:
            o = o * dense.pointwise(torch.sigmoid, self.g_proj(x).float()).to(o.dtype)[..., None]
        return self.o_proj(o.reshape(x.shape[0], d.num_heads * d.v_head_dim))

    def forward(self, x: torch.Tensor, ctx: LayerContext, ref: StateRef) -> torch.Tensor:
        batch = ctx.batch
        query, latent = self.absorbed(x, ctx)
        pool = ctx.pools.kv.layer(ref)["latent"]
        o = mla_attention(
            query,
            latent,
            pool,
            batch.out_loc,
            batch.page_table,
            batch.cu_seqlens,
            batch.seq_lens,
            batch.page_size,
            self.dims.scale,
            self.dims.kv_lora_rank,
        )
        return self.project_out(o, x)
