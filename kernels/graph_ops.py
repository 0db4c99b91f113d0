"""The Triton kernels as opaque custom ops: what a compiled GPU step traces.

A compiled step (``workers/compiled``: ``torch.compile(fullgraph=True)``, CUDA graphs on a
GPU) cannot trace into our Triton launchers: they plan their launches in Python
(``kernels.chunking.launch_plan`` is memoised by tensor identity and reads the host outside
a capture) and pick tile sizes from shapes. So each launcher is also a custom op
``hybridserve::<name>_triton``, and the dispatchers call the launchers through the functions
here:

- eagerly (every step that is not traced) the launcher itself: no op dispatch per call;
- while dynamo traces, the custom op: opaque to dynamo and inductor, it runs as one call from
  the compiled graph and is captured into the CUDA graph with the rest. A compiled step is a
  decode or a verify, whose recurrent launches plan from shapes (``uniform_len``:
  ``kernels.chunking.uniform_plan``, no host read, nothing memoised), so the capture holds
  them. So eager and compiled steps launch the same kernels, and a token gets the same bits
  in both.

Each op declares the pools it writes in place (``mutates_args``: functionalization keeps
the writes in place; the pools of a compiled GPU step are static addresses) and has a fake
that gives its output's shape and dtype. Every output is a new, contiguous tensor. The
launcher modules are imported on an op's first call, as the dispatchers do: a CPU process
that never selects Triton never imports Triton.

(No ``from __future__ import annotations`` here: ``custom_op`` reads the annotations.)
"""
import math
from typing import Callable, Optional

import torch
from torch import Tensor

MutatedArgs = tuple[str, ...]


def _opaque(name: str, fn: Callable[..., Tensor], mutates: MutatedArgs,
            fake: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """``fn`` eagerly, the custom op ``hybridserve::<name>_triton`` while dynamo traces."""
    op = torch.library.custom_op(f"hybridserve::{name}_triton", fn, mutates_args=mutates)
    op.register_fake(fake)

    def call(*args: object, **kwargs: object) -> Tensor:
        return (op if torch.compiler.is_compiling() else fn)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"The Triton launcher of ``{name}`` (an opaque op when traced)."
    return call


def _like(t: Tensor, *shape: int) -> Tensor:
    return t.new_empty(shape or t.shape)


# -- recurrent mixers: out is [T, H, V] (GDN, KDA) or [T, H, P] / [T, D] (SSD, Mamba1) ---------
def _gdn(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, states: Tensor,
         cu_seqlens: Tensor, slot_ids: Tensor, has_initial_state: Tensor,
         scale: Optional[float] = None, use_qk_l2norm: bool = True, chunk_size: int = 64,
         state_dst_slots: Optional[Tensor] = None, uniform_len: int = 0) -> Tensor:
    from kernels.gdn.triton_varlen import gated_delta_rule_varlen_triton
    return gated_delta_rule_varlen_triton(q, k, v, g, beta, states, cu_seqlens, slot_ids,
                                          has_initial_state, scale, use_qk_l2norm, chunk_size,
                                          state_dst_slots, uniform_len=uniform_len)


def _kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, states: Tensor,
         cu_seqlens: Tensor, slot_ids: Tensor, has_initial_state: Tensor,
         scale: Optional[float] = None, use_qk_l2norm: bool = True,
         state_dst_slots: Optional[Tensor] = None, uniform_len: int = 0) -> Tensor:
    from kernels.kda.triton_varlen import kda_varlen_triton
    return kda_varlen_triton(q, k, v, g, beta, states, cu_seqlens, slot_ids, has_initial_state,
                             scale, use_qk_l2norm, state_dst_slots, uniform_len=uniform_len)


def _ssd(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, dt_bias: Tensor,
         states: Tensor, cu_seqlens: Tensor, slot_ids: Tensor, has_initial_state: Tensor,
         dt_softplus: bool, dt_min: float, dt_max: float, chunk_size: int,
         state_dst_slots: Optional[Tensor], uniform_len: int) -> Tensor:
    from kernels.ssd.triton_varlen import ssd_varlen_triton
    return ssd_varlen_triton(x, dt, A, B, C, D, dt_bias, states, cu_seqlens, slot_ids,
                             has_initial_state, dt_softplus, (dt_min, dt_max), chunk_size,
                             state_dst_slots, uniform_len=uniform_len)


def _selective_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
                    dt_bias: Optional[Tensor], states: Tensor, cu_seqlens: Tensor,
                    slot_ids: Tensor, has_initial_state: Tensor, dt_softplus: bool = True,
                    chunk_size: int = 64, state_dst_slots: Optional[Tensor] = None,
                    uniform_len: int = 0) -> Tensor:
    from kernels.selective_scan.triton_varlen import selective_scan_varlen_triton
    return selective_scan_varlen_triton(x, dt, A, B, C, D, dt_bias, states, cu_seqlens, slot_ids,
                                        has_initial_state, dt_softplus, chunk_size,
                                        state_dst_slots, uniform_len=uniform_len)


gdn_varlen = _opaque("gdn_varlen", _gdn, ("states",), lambda q, k, v, *_: _like(v))
kda_varlen = _opaque("kda_varlen", _kda, ("states",), lambda q, k, v, *_: _like(v))
_ssd_call = _opaque("ssd_varlen", _ssd, ("states",), lambda x, *_: _like(x))
selective_scan_varlen = _opaque("selective_scan_varlen", _selective_scan, ("states",),
                                lambda x, *_: _like(x))


def ssd_varlen(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor,
               dt_bias: Tensor, states: Tensor, cu_seqlens: Tensor, slot_ids: Tensor,
               has_initial_state: Tensor, dt_softplus: bool = True,
               dt_limit: tuple[float, float] = (0.0, math.inf), chunk_size: int = 256,
               state_dst_slots: Optional[Tensor] = None, uniform_len: int = 0) -> Tensor:
    """The SSD launcher's signature (``dt_limit`` a pair: the op takes its two floats)."""
    return _ssd_call(x, dt, A, B, C, D, dt_bias, states, cu_seqlens, slot_ids, has_initial_state,
                     bool(dt_softplus), float(dt_limit[0]), float(dt_limit[1]), int(chunk_size),
                     state_dst_slots, int(uniform_len))


# -- causal conv1d: out is [T, D] ------------------------------------------------------------
def _conv_varlen(x: Tensor, weight: Tensor, bias: Optional[Tensor], conv_states: Tensor,
                 cu_seqlens: Tensor, slot_ids: Tensor, has_initial_state: Tensor,
                 activation: Optional[str] = "silu",
                 state_dst_slots: Optional[Tensor] = None) -> Tensor:
    from kernels.conv1d.triton_conv import causal_conv1d_varlen_triton
    return causal_conv1d_varlen_triton(x, weight, bias, conv_states, cu_seqlens, slot_ids,
                                       has_initial_state, activation, state_dst_slots)


def _conv_update(x: Tensor, weight: Tensor, bias: Optional[Tensor], conv_states: Tensor,
                 slot_ids: Tensor, activation: Optional[str] = "silu") -> Tensor:
    from kernels.conv1d.triton_conv import causal_conv1d_update_triton
    return causal_conv1d_update_triton(x, weight, bias, conv_states, slot_ids, activation)


conv1d_varlen = _opaque("conv1d_varlen", _conv_varlen, ("conv_states",), lambda x, *_: _like(x))
conv1d_update = _opaque("conv1d_update", _conv_update, ("conv_states",), lambda x, *_: _like(x))


# -- norms: out is x's shape -------------------------------------------------------------------
def _rms_norm(x: Tensor, weight: Tensor, eps: float, zero_centered: bool = False) -> Tensor:
    from kernels.norm.triton_norm import rms_norm_triton
    return rms_norm_triton(x, weight, eps, zero_centered)


def _gated_rms_norm(x: Tensor, z: Tensor, weight: Tensor, eps: float,
                    group_size: Optional[int] = None, norm_before_gate: bool = True) -> Tensor:
    from kernels.norm.triton_norm import gated_rms_norm_triton
    return gated_rms_norm_triton(x, z, weight, eps, group_size, norm_before_gate)


rms_norm = _opaque("rms_norm", _rms_norm, (), lambda x, *_: _like(x))
gated_rms_norm = _opaque("gated_rms_norm", _gated_rms_norm, (), lambda x, *_: _like(x))


# -- paged attention (writes the new K/V, or latents, into the pools first) ------------------
def _attention(q: Tensor, k: Tensor, v: Tensor, k_pool: Tensor, v_pool: Tensor, out_loc: Tensor,
               page_table: Tensor, cu_seqlens: Tensor, seq_lens: Tensor, page_size: int,
               scale: float, window: Optional[int] = None) -> Tensor:
    from kernels.attention.triton_paged import paged_attention_triton
    return paged_attention_triton(q, k, v, k_pool, v_pool, out_loc, page_table, cu_seqlens,
                                  seq_lens, page_size, scale, window)


def _mla(q: Tensor, latent: Tensor, pool: Tensor, out_loc: Tensor, page_table: Tensor,
         cu_seqlens: Tensor, seq_lens: Tensor, page_size: int, scale: float,
         latent_dim: int) -> Tensor:
    from kernels.mla.triton_paged import mla_attention_triton
    return mla_attention_triton(q, latent, pool, out_loc, page_table, cu_seqlens, seq_lens,
                                page_size, scale, latent_dim)


paged_attention = _opaque("paged_attention", _attention, ("k_pool", "v_pool"),
                          lambda q, *_: _like(q))
mla_attention = _opaque("mla_attention", _mla, ("pool",),
                        lambda q, *args: _like(q, q.shape[0], q.shape[1], args[-1]))
