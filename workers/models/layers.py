"""Pieces shared by the model families: norms, rotary embedding, paged attention, dense MLP.

Every layer works on the flat token batch of ``ForwardBatch``: activations are ``[T, hidden]``
and per-head tensors ``[T, H, D]``. Parameters keep the names and layouts of the HF
checkpoints (one ``nn.Linear`` per projection), so a later tensor-parallel pass can shard them
by heads / rows without undoing any fusing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kernels import dense, fused_cpu
from kernels.attention import paged_attention
from kernels.conv1d import causal_conv1d
from kernels.norm import gated_rms_norm, rms_norm
from workers.device_pools import DevicePools
from workers.forward_batch import ForwardBatch
from workers.models.lora import LoraAdapters
from workers.models.weights import WeightTarget, split, whole
from workers.state_spec import StateKind, StateRef, attention_kind

RopeTables = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [T, rotary_dim] each


class LayerContext(NamedTuple):
    """What every layer of one forward step shares; stateful layers also get their ``StateRef``."""

    batch: ForwardBatch
    pools: DevicePools
    rope: RopeTables | None = None
    embeddings: torch.Tensor | None = None  # the scaled input embeddings [T, hidden] (Zamba2)


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


# HF ``hidden_act`` names -> the function transformers' ACT2FN computes for them.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "relu": F.relu,
    "relu2": _relu2,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str, field: str = "hidden_act") -> Callable[[torch.Tensor], torch.Tensor]:
    fn = ACTIVATIONS.get(name)
    if fn is None:
        raise ValueError(f"{field}={name!r} is not supported; expected one of {sorted(ACTIVATIONS)}")
    return fn


def linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> nn.Linear:
    """A projection: ``nn.Linear`` whose CPU fp32 forward takes the few-rows kernel or the
    faster library (``kernels/dense.py``)."""
    return dense.Linear(in_features, out_features, bias=bias, dtype=dtype)


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

    def __init__(
        self, dim: int, eps: float, dtype: torch.dtype, group_size: int | None, norm_before_gate: bool
    ) -> None:
        super().__init__()
        self.weight = param(dim, dtype=dtype)
        self.eps = eps
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(
            x, z, self.weight, self.eps, group_size=self.group_size, norm_before_gate=self.norm_before_gate
        )


class RotaryEmbedding:
    """Default (unscaled) RoPE on the first ``rotary_dim`` dims of each head, rotate-half layout."""

    def __init__(self, rotary_dim: int, theta: float) -> None:
        if rotary_dim <= 0 or rotary_dim % 2:
            raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
        self.rotary_dim = rotary_dim
        self.theta = theta

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """[rotary_dim / 2] fp32 angular frequencies (a subclass may reshape the spectrum)."""
        exps = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device=device)
        return 1.0 / (self.theta ** (exps / self.rotary_dim))

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """cos/sin for int64 ``positions [T]`` (any start, not assumed 0), cast to ``dtype``."""
        freqs = positions.float()[:, None] * self.inv_freq(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, rope: RopeTables) -> torch.Tensor:
    """x [T, H, D]: rotate dims ``0:rotary_dim`` by the per-token angles; the rest pass through."""
    if x.dim() == 3 and fused_cpu.usable(x, *rope):  # eager CPU fp32: one pass (kernels.fused_cpu)
        return fused_cpu.rope(x, *rope)
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
    output_gate: bool = False  # q_proj also emits a per-head sigmoid gate (Qwen3-Next)
    qk_norm_eps: float | None = None  # per-head RMSNorm on q and k (Qwen3-Next, LFM2, Lfm3)
    qk_norm_zero_centered: bool = True  # ... as ``1 + w`` (Qwen3-Next) or plain ``w`` (LFM)
    head_gate: bool = False  # g_proj: one sigmoid gate per head from the input (Lfm3)
    sliding_window: int | None = None  # attend to the last W positions only (Lfm3 sliding layers)
    output_size: int | None = None  # o_proj's output width (default hidden_size; Zamba2: less)
    key_multiplier: float = 1.0  # k_proj's output scaled before RoPE (Falcon-H1)
    adapter_rank: int = 0  # > 0: q/k/v LoRA adapters for these invocations (Zamba2)
    adapter_invocations: tuple[int, ...] = ()


class Attention(nn.Module):
    """GQA self-attention over the paged KV pool; RoPE optional (``ctx.rope`` None: NoPE;
    q and k come back in their own dtype whatever the tables', so fp32 tables give Lfm3's
    fp32 rotation). A sliding window keeps every token's KV in the pool and reads the last W.

    ``forward(x, ctx, ref, adapter)``: ``ref`` names this layer's (or this invocation's) KV in
    the pool; ``adapter`` the invocation whose q/k/v LoRA adapters apply (Zamba2), if any.
    """

    def __init__(self, dims: AttentionDims, dtype: torch.dtype) -> None:
        super().__init__()
        if dims.num_heads % dims.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={dims.num_heads} is not a multiple of num_key_value_heads={dims.num_kv_heads}"
            )
        assert not (dims.output_gate and dims.head_gate), "one output gate per attention"
        self.dims = dims
        q_width = dims.num_heads * dims.head_dim * (2 if dims.output_gate else 1)
        kv_width = dims.num_kv_heads * dims.head_dim
        self.q_proj = linear(dims.hidden_size, q_width, dims.bias, dtype)
        self.k_proj = linear(dims.hidden_size, kv_width, dims.bias, dtype)
        self.v_proj = linear(dims.hidden_size, kv_width, dims.bias, dtype)
        self.o_proj = linear(dims.num_heads * dims.head_dim, dims.output_size or dims.hidden_size, dims.bias, dtype)
        if dims.qk_norm_eps is not None:
            centred = dims.qk_norm_zero_centered
            self.q_norm = RMSNorm(dims.head_dim, dims.qk_norm_eps, dtype, zero_centered=centred)
            self.k_norm = RMSNorm(dims.head_dim, dims.qk_norm_eps, dtype, zero_centered=centred)
        self.g_proj = linear(dims.hidden_size, dims.num_heads, False, dtype) if dims.head_gate else None
        self.adapters: tuple[LoraAdapters, ...] = ()
        if dims.adapter_rank:
            for name, width in (("q", q_width), ("k", kv_width), ("v", kv_width)):
                self.add_module(
                    f"linear_{name}_adapter_list",
                    LoraAdapters(dims.hidden_size, dims.adapter_rank, (width,), dims.adapter_invocations, dtype),
                )
            self.adapters = (self.linear_q_adapter_list, self.linear_k_adapter_list, self.linear_v_adapter_list)

    def state_kind(self) -> StateKind:
        return attention_kind(self.dims.num_kv_heads, self.dims.head_dim)

    def forward(self, x: torch.Tensor, ctx: LayerContext, ref: StateRef, adapter: int | None = None) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if adapter is not None and self.adapters:
            q, k, v = (p + a(x, adapter)[0] for p, a in zip((q, k, v), self.adapters))
        gate = None
        if self.g_proj is not None:  # [T, H] -> one gate logit per output channel
            gate = self.g_proj(x).repeat_interleave(self.dims.head_dim, dim=-1)
        return self.attend(q, k, v, ctx, ref, gate)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: LayerContext,
        ref: StateRef,
        gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """From the flat projections q [T, q_width], k, v [T, H_kv * D] to ``o_proj``'s output;
        ``gate`` [T, H * D]: sigmoid gate logits on the attention output (Lfm3's g_proj)."""
        q, k, v, gate = self.heads(q, k, v, ctx, gate)
        batch = ctx.batch
        kv = ctx.pools.kv.layer(ref)
        o = paged_attention(
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            kv["k"],
            kv["v"],
            batch.out_loc,
            batch.page_table,
            batch.cu_seqlens,
            batch.seq_lens,
            batch.page_size,
            self.dims.scale,
            self.dims.sliding_window,
        )
        return self.output(o, gate)

    def heads(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: LayerContext, gate: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The flat projections -> q [T, H, D], k, v [T, H_kv, D] (normed, roped) and the output
        gate logits [T, H * D] (``output_gate``'s half of q_proj, or ``gate`` as given)."""
        d = self.dims
        num_tokens = q.shape[0]
        if d.output_gate:
            # per head: [query (head_dim) | gate (head_dim)]
            q, gate = q.view(num_tokens, d.num_heads, 2 * d.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(num_tokens, -1)
        q = q.reshape(num_tokens, d.num_heads, d.head_dim)
        k = k.view(num_tokens, d.num_kv_heads, d.head_dim)
        if d.key_multiplier != 1.0:
            k = k * d.key_multiplier
        v = v.view(num_tokens, d.num_kv_heads, d.head_dim)
        if d.qk_norm_eps is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if ctx.rope is not None:
            q, k = apply_rotary(q, ctx.rope).to(q.dtype), apply_rotary(k, ctx.rope).to(k.dtype)
        return q, k, v, gate

    def output(self, o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """o [T, H, D] -> ``o_proj(o * sigmoid(gate))`` (no gate: ``o_proj(o)``)."""
        o = o.reshape(o.shape[0], self.dims.num_heads * self.dims.head_dim)
        if gate is not None:
            o = o * dense.pointwise(torch.sigmoid, gate)
        return self.o_proj(o)


class DenseMLP(nn.Module):
    """Gated MLP ``down(act(gate(x) * gm) * up(x)) * dm`` (SwiGLU by default), or with
    ``gated=False`` ``down(act(up(x))) * dm`` (Nemotron-H's relu^2 MLP); ``gm`` / ``dm`` are
    Falcon-H1's ``mlp_multipliers``.

    ``fused_names=(in, out)`` loads a checkpoint that stores ``in.weight = cat(gate, up)`` and
    ``out.weight = down`` (Granite's ``shared_mlp.input_linear`` / ``output_linear``, Zamba2's
    ``gate_up_proj`` / ``down_proj``). ``adapter_rank`` adds Zamba2's per-invocation LoRA on
    ``[gate | up]`` (``gate_up_proj_adapter_list``), applied by ``forward(x, adapter=i)``.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        fused_names: tuple[str, str] | None = None,
        *,
        act: str = "silu",
        gated: bool = True,
        bias: bool = False,
        gate_multiplier: float = 1.0,
        down_multiplier: float = 1.0,
        adapter_rank: int = 0,
        adapter_invocations: tuple[int, ...] = (),
    ) -> None:
        super().__init__()
        self.gate_proj = linear(hidden_size, intermediate_size, bias, dtype) if gated else None
        self.up_proj = linear(hidden_size, intermediate_size, bias, dtype)
        self.down_proj = linear(intermediate_size, hidden_size, bias, dtype)
        self.fused_names = fused_names
        self.act = activation(act)
        # kernels.fused_cpu may take it
        self.fused_silu = act in ("silu", "swish") and gate_multiplier == 1.0
        self.gate_multiplier, self.down_multiplier = gate_multiplier, down_multiplier
        self.gate_up_proj_adapter_list: LoraAdapters | None = None
        if adapter_rank:
            assert gated, "the adapters feed [gate | up]"
            self.gate_up_proj_adapter_list = LoraAdapters(
                hidden_size, adapter_rank, (intermediate_size, intermediate_size), adapter_invocations, dtype
            )

    @property
    def intermediate_size(self) -> int:
        return self.up_proj.out_features

    def forward(self, x: torch.Tensor, adapter: int | None = None) -> torch.Tensor:
        if self.gate_proj is None:
            h = self.act(self.up_proj(x))
        else:
            g, u = self.gate_proj(x), self.up_proj(x)
            if adapter is not None and self.gate_up_proj_adapter_list is not None:
                ag, au = self.gate_up_proj_adapter_list(x, adapter)
                g, u = g + ag, u + au
            h = self._inner(g, u)
        out = self.down_proj(h)
        return out if self.down_multiplier == 1.0 else out * self.down_multiplier

    def _inner(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """act(g * gm) * u: one fused pass on CPU fp32 for SiLU (``kernels.fused_cpu``)."""
        if self.fused_silu and fused_cpu.usable(g, u):
            return fused_cpu.silu_and_mul(g, u)
        return self.act(g if self.gate_multiplier == 1.0 else g * self.gate_multiplier) * u

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        targets: dict[str, WeightTarget] = {}
        if self.fused_names is None:
            for name in ("gate_proj", "up_proj", "down_proj"):
                proj = getattr(self, name)
                if proj is not None:
                    targets[f"{prefix}{name}.weight"] = whole(proj.weight)
                    if proj.bias is not None:
                        targets[f"{prefix}{name}.bias"] = whole(proj.bias)
        else:
            assert self.gate_proj is not None
            in_name, out_name = self.fused_names
            targets[f"{prefix}{in_name}.weight"] = split(0, self.gate_proj.weight, self.up_proj.weight)
            targets[f"{prefix}{out_name}.weight"] = whole(self.down_proj.weight)
            if self.gate_proj.bias is not None:
                assert self.up_proj.bias is not None and self.down_proj.bias is not None
                targets[f"{prefix}{in_name}.bias"] = split(0, self.gate_proj.bias, self.up_proj.bias)
                targets[f"{prefix}{out_name}.bias"] = whole(self.down_proj.bias)
        if self.gate_up_proj_adapter_list is not None:
            targets.update(self.gate_up_proj_adapter_list.weight_targets(f"{prefix}gate_up_proj_adapter_list."))
        return targets


class CausalConv1d(nn.Module):
    """Depthwise causal conv + SiLU of the recurrent mixers (``activation=None``: no
    activation, LFM2's short conv), state in the Mamba pool.

    ``weight`` keeps the HF ``nn.Conv1d`` layout ``[D, 1, W]``; the pool's conv state of the
    layer is ``[S, D, W-1]`` (the last W-1 inputs, oldest first).
    """

    def __init__(self, dim: int, width: int, bias: bool, dtype: torch.dtype, activation: str | None = "silu") -> None:
        super().__init__()
        self.weight = param(dim, 1, width, dtype=dtype)
        self.bias = param(dim, dtype=dtype) if bias else None
        self.activation = activation

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return causal_conv1d(
            x, self.weight[:, 0, :], self.bias, conv_state, batch.recurrent, activation=self.activation
        )
