"""Pieces shared by the model families: norms, rotary embedding, paged attention, dense MLP.

Every layer works on the flat token batch of ``ForwardBatch``: activations are ``[T, hidden]``
and per-head tensors ``[T, H, D]``. Parameters keep the names and layouts of the HF
checkpoints (one ``nn.Linear`` per projection), so a later tensor-parallel pass can shard them
by heads / rows without undoing any fusing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.attention import paged_attention
from kernels.conv1d import causal_conv1d_update, causal_conv1d_varlen, causal_conv1d_verify
from kernels.norm import gated_rms_norm, rms_norm
from workers.device_pools import DevicePools
from workers.forward_batch import ForwardBatch
from workers.models.weights import WeightTarget, split, whole

RopeTables = tuple[torch.Tensor, torch.Tensor]   # cos, sin: [T, rotary_dim] each


def linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=bias, dtype=dtype)


def param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim; ``zero_centered`` applies ``(1 + weight)`` (Qwen3-Next)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, zero_centered: bool = False) -> None:
        super().__init__()
        self.weight = param(dim, dtype=dtype)
        self.eps = eps
        self.zero_centered = zero_centered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, zero_centered=self.zero_centered)


class GatedRMSNorm(nn.Module):
    """``norm(x) * silu(z)`` (norm_before_gate) or ``norm(x * silu(z))``, over groups of the last dim."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, group_size: int | None,
                 norm_before_gate: bool) -> None:
        super().__init__()
        self.weight = param(dim, dtype=dtype)
        self.eps = eps
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, z, self.weight, self.eps, group_size=self.group_size,
                              norm_before_gate=self.norm_before_gate)


class RotaryEmbedding:
    """Default (unscaled) RoPE on the first ``rotary_dim`` dims of each head, rotate-half layout."""

    def __init__(self, rotary_dim: int, theta: float) -> None:
        if rotary_dim <= 0 or rotary_dim % 2:
            raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
        self.rotary_dim = rotary_dim
        self.theta = theta

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """cos/sin for int64 ``positions [T]`` (any start, not assumed 0), cast to ``dtype``."""
        exps = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device=positions.device)
        inv_freq = 1.0 / (self.theta ** (exps / self.rotary_dim))
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, rope: RopeTables) -> torch.Tensor:
    """x [T, H, D]: rotate dims ``0:rotary_dim`` by the per-token angles; the rest pass through."""
    cos, sin = rope[0][:, None, :], rope[1][:, None, :]
    rot_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    half = rot_dim // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


@dataclass(frozen=True)
class AttentionDims:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    bias: bool
    scale: float
    output_gate: bool = False            # q_proj also emits a per-head sigmoid gate (Qwen3-Next)
    qk_norm_eps: float | None = None     # per-head zero-centred RMSNorm on q and k (Qwen3-Next)


class Attention(nn.Module):
    """GQA self-attention over the paged KV pool; RoPE optional (NoPE models pass ``None``)."""

    def __init__(self, dims: AttentionDims, dtype: torch.dtype) -> None:
        super().__init__()
        if dims.num_heads % dims.num_kv_heads:
            raise ValueError(f"num_attention_heads={dims.num_heads} is not a multiple of "
                             f"num_key_value_heads={dims.num_kv_heads}")
        self.dims = dims
        q_width = dims.num_heads * dims.head_dim * (2 if dims.output_gate else 1)
        kv_width = dims.num_kv_heads * dims.head_dim
        self.q_proj = linear(dims.hidden_size, q_width, dims.bias, dtype)
        self.k_proj = linear(dims.hidden_size, kv_width, dims.bias, dtype)
        self.v_proj = linear(dims.hidden_size, kv_width, dims.bias, dtype)
        self.o_proj = linear(dims.num_heads * dims.head_dim, dims.hidden_size, dims.bias, dtype)
        if dims.qk_norm_eps is not None:
            self.q_norm = RMSNorm(dims.head_dim, dims.qk_norm_eps, dtype, zero_centered=True)
            self.k_norm = RMSNorm(dims.head_dim, dims.qk_norm_eps, dtype, zero_centered=True)

    def forward(self, x: torch.Tensor, rope: RopeTables | None, batch: ForwardBatch,
                pools: DevicePools, attn_idx: int) -> torch.Tensor:
        d = self.dims
        num_tokens = x.shape[0]
        q = self.q_proj(x)
        gate = None
        if d.output_gate:
            # per head: [query (head_dim) | gate (head_dim)]
            q, gate = q.view(num_tokens, d.num_heads, 2 * d.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(num_tokens, -1)
        q = q.reshape(num_tokens, d.num_heads, d.head_dim)
        k = self.k_proj(x).view(num_tokens, d.num_kv_heads, d.head_dim)
        v = self.v_proj(x).view(num_tokens, d.num_kv_heads, d.head_dim)
        if d.qk_norm_eps is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        o = paged_attention(q.contiguous(), k.contiguous(), v.contiguous(),
                            pools.kv.k[attn_idx], pools.kv.v[attn_idx], batch.out_loc,
                            batch.page_table, batch.cu_seqlens, batch.seq_lens,
                            batch.page_size, d.scale)
        o = o.reshape(num_tokens, d.num_heads * d.head_dim)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o)


class DenseMLP(nn.Module):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))``.

    ``fused_names=(in, out)`` loads a checkpoint that stores ``in.weight = cat(gate, up)`` and
    ``out.weight = down`` (Granite's ``shared_mlp.input_linear`` / ``output_linear``).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 fused_names: tuple[str, str] | None = None) -> None:
        super().__init__()
        self.gate_proj = linear(hidden_size, intermediate_size, False, dtype)
        self.up_proj = linear(hidden_size, intermediate_size, False, dtype)
        self.down_proj = linear(intermediate_size, hidden_size, False, dtype)
        self.fused_names = fused_names

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        if self.fused_names is None:
            return {f"{prefix}{n}.weight": whole(getattr(self, n).weight)
                    for n in ("gate_proj", "up_proj", "down_proj")}
        in_name, out_name = self.fused_names
        return {f"{prefix}{in_name}.weight": split(0, self.gate_proj.weight, self.up_proj.weight),
                f"{prefix}{out_name}.weight": whole(self.down_proj.weight)}


class CausalConv1d(nn.Module):
    """Depthwise causal conv + SiLU of the recurrent mixers, state in the Mamba pool.

    ``weight`` keeps the HF ``nn.Conv1d`` layout ``[D, 1, W]``; the pool's conv state of the
    layer is ``[S, D, W-1]`` (the last W-1 inputs, oldest first).
    """

    def __init__(self, dim: int, width: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = param(dim, 1, width, dtype=dtype)
        self.bias = param(dim, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if batch.decode_only:       # one token per sequence, all with a state: same result
            return causal_conv1d_update(x, self.weight[:, 0, :], self.bias, conv_state,
                                        batch.mamba_slot_ids, activation="silu")
        if batch.verify_len:        # T tokens per sequence, a snapshot at each: same result
            assert batch.state_dst_slots is not None
            return causal_conv1d_verify(x, self.weight[:, 0, :], self.bias, conv_state,
                                        batch.cu_seqlens, batch.mamba_slot_ids, batch.has_initial_state,
                                        batch.state_dst_slots, batch.verify_len, activation="silu")
        return causal_conv1d_varlen(x, self.weight[:, 0, :], self.bias, conv_state,
                                    batch.cu_seqlens, batch.mamba_slot_ids,
                                    batch.has_initial_state, activation="silu",
                                    state_dst_slots=batch.state_dst_slots)
