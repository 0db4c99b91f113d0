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

import functools
import importlib
from typing import Callable, Optional

import torch
from torch import Tensor

from kernels.recurrent_batch import Path, RecurrentBatch

MutatedArgs = tuple[str, ...]


def _opaque(
    name: str, fn: Callable[..., Tensor], mutates: MutatedArgs, fake: Callable[..., Tensor]
) -> Callable[..., Tensor]:
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
# A launcher takes ``(*inputs, states, seqs: RecurrentBatch, *options)``; its op the same with
# ``seqs.launch_args()`` spread in place of ``seqs`` (an op's arguments are tensors and scalars).
Launcher = Callable[..., Tensor]
_SEQS_SCHEMA = "Tensor cu_seqlens, Tensor slot_ids, Tensor has_initial_state, Tensor? state_dst_slots, int uniform_len"
_NUM_SEQS_ARGS = 5


@functools.cache
def _launcher(path: str) -> Launcher:
    """The launcher ``module:function``, imported on its first call."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _recurrent(name: str, launcher: str, inputs: str, options: str, out_like: int) -> Callable[..., Tensor]:
    """The launcher eagerly; while dynamo traces, the custom op ``hybridserve::<name>_triton``
    of schema ``(inputs, seqs' fields, options)``. ``inputs`` ends with the pool, ``states``;
    the output is shaped as input ``out_like``."""
    n = len(inputs.split(","))

    def flat(*args: object) -> Tensor:
        seqs = RecurrentBatch(*args[n : n + _NUM_SEQS_ARGS])  # type: ignore[arg-type]
        return _launcher(launcher)(*args[:n], seqs, *args[n + _NUM_SEQS_ARGS :])

    op = torch.library.custom_op(
        f"hybridserve::{name}_triton",
        flat,
        mutates_args=("states",),
        schema=f"({inputs}, {_SEQS_SCHEMA}{', ' + options if options else ''}) -> Tensor",
    )
    op.register_fake(lambda *args: _like(args[out_like]))

    def call(*args: object) -> Tensor:
        if not torch.compiler.is_compiling():
            return _launcher(launcher)(*args)
        seqs = args[n]
        assert isinstance(seqs, RecurrentBatch)
        return op(*args[:n], *seqs.launch_args(), *args[n + 1 :])

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"The Triton launcher of ``{name}`` (an opaque op when traced)."
    return call


_DELTA_RULE_INPUTS = "Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) states"
_DELTA_RULE_OPTIONS = "float? scale, bool use_qk_l2norm, int chunk_size"
_SCAN_INPUTS = "Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D, Tensor? dt_bias, Tensor(a!) states"
gdn = _recurrent(
    "gdn",
    "kernels.gdn.triton_varlen:gated_delta_rule_varlen_triton",
    _DELTA_RULE_INPUTS,
    _DELTA_RULE_OPTIONS,
    out_like=2,
)
kda = _recurrent(
    "kda", "kernels.kda.triton_varlen:kda_varlen_triton", _DELTA_RULE_INPUTS, _DELTA_RULE_OPTIONS, out_like=2
)
ssd = _recurrent(
    "ssd",
    "kernels.ssd.triton_varlen:ssd_varlen_triton",
    _SCAN_INPUTS,
    "bool dt_softplus, float[] dt_limit, int chunk_size",
    out_like=0,
)
selective_scan = _recurrent(
    "selective_scan",
    "kernels.selective_scan.triton_varlen:selective_scan_varlen_triton",
    _SCAN_INPUTS,
    "bool dt_softplus, int chunk_size",
    out_like=0,
)
rglru = _recurrent(
    "rglru",
    "kernels.rglru.triton_scan:rglru_triton",
    "Tensor x, Tensor gx, Tensor ga, Tensor log_a_scale, Tensor reset, Tensor(a!) states",
    "",
    out_like=0,
)


# -- causal conv1d: out is [T, D] ------------------------------------------------------------
def _conv_varlen(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    conv_states: Tensor,
    cu_seqlens: Tensor,
    slot_ids: Tensor,
    has_initial_state: Tensor,
    activation: Optional[str] = "silu",
    state_dst_slots: Optional[Tensor] = None,
) -> Tensor:
    from kernels.conv1d.triton_conv import causal_conv1d_varlen_triton

    return causal_conv1d_varlen_triton(
        x, weight, bias, conv_states, cu_seqlens, slot_ids, has_initial_state, activation, state_dst_slots
    )


def _conv_update(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    conv_states: Tensor,
    slot_ids: Tensor,
    activation: Optional[str] = "silu",
) -> Tensor:
    from kernels.conv1d.triton_conv import causal_conv1d_update_triton

    return causal_conv1d_update_triton(x, weight, bias, conv_states, slot_ids, activation)


_conv1d_varlen = _opaque("conv1d_varlen", _conv_varlen, ("conv_states",), lambda x, *_: _like(x))
_conv1d_update = _opaque("conv1d_update", _conv_update, ("conv_states",), lambda x, *_: _like(x))


def conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    conv_states: Tensor,
    seqs: RecurrentBatch,
    activation: Optional[str],
) -> Tensor:
    """The Triton conv of ``seqs``: the one-token kernel on a decode, else the varlen launcher."""
    if seqs.path is Path.DECODE:
        return _conv1d_update(x, weight, bias, conv_states, seqs.slot_ids, activation)
    return _conv1d_varlen(
        x,
        weight,
        bias,
        conv_states,
        seqs.cu_seqlens,
        seqs.slot_ids,
        seqs.has_initial_state,
        activation,
        seqs.state_dst_slots,
    )


# -- norms: out is x's shape -------------------------------------------------------------------
def _rms_norm(x: Tensor, weight: Tensor, eps: float, zero_centered: bool = False) -> Tensor:
    from kernels.norm.triton_norm import rms_norm_triton

    return rms_norm_triton(x, weight, eps, zero_centered)


def _gated_rms_norm(
    x: Tensor, z: Tensor, weight: Tensor, eps: float, group_size: Optional[int] = None, norm_before_gate: bool = True
) -> Tensor:
    from kernels.norm.triton_norm import gated_rms_norm_triton

    return gated_rms_norm_triton(x, z, weight, eps, group_size, norm_before_gate)


rms_norm = _opaque("rms_norm", _rms_norm, (), lambda x, *_: _like(x))
gated_rms_norm = _opaque("gated_rms_norm", _gated_rms_norm, (), lambda x, *_: _like(x))


# -- paged attention (writes the new K/V, or latents, into the pools first) ------------------
def _attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    out_loc: Tensor,
    page_table: Tensor,
    cu_seqlens: Tensor,
    seq_lens: Tensor,
    page_size: int,
    scale: float,
    window: Optional[int] = None,
) -> Tensor:
    from kernels.attention.triton_paged import paged_attention_triton

    return paged_attention_triton(
        q, k, v, k_pool, v_pool, out_loc, page_table, cu_seqlens, seq_lens, page_size, scale, window
    )


def _mla(
    q: Tensor,
    latent: Tensor,
    pool: Tensor,
    out_loc: Tensor,
    page_table: Tensor,
    cu_seqlens: Tensor,
    seq_lens: Tensor,
    page_size: int,
    scale: float,
    latent_dim: int,
) -> Tensor:
    from kernels.mla.triton_paged import mla_attention_triton

    return mla_attention_triton(
        q, latent, pool, out_loc, page_table, cu_seqlens, seq_lens, page_size, scale, latent_dim
    )


paged_attention = _opaque("paged_attention", _attention, ("k_pool", "v_pool"), lambda q, *_: _like(q))
mla_attention = _opaque("mla_attention", _mla, ("pool",), lambda q, *args: _like(q, q.shape[0], q.shape[1], args[-1]))


# -- indexed attention (``kernels.indexer``): the selection, then attention over it -----------
def _indexer_select(
    q: Tensor,
    weights: Optional[Tensor],
    block_keys: Tensor,
    cu_seqlens: Tensor,
    seq_lens: Tensor,
    block_size: int,
    top_blocks: int,
    pre_scale: float = 1.0,
    post_scale: float = 1.0,
    tail: bool = True,
) -> Tensor:
    from kernels.indexer.triton_select import select_positions_triton

    return select_positions_triton(
        q, weights, block_keys, cu_seqlens, seq_lens, block_size, top_blocks, pre_scale, post_scale, tail
    )


def _indexer_sparse(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    positions: Tensor,
    page_table: Tensor,
    cu_seqlens: Tensor,
    seq_lens: Tensor,
    page_size: int,
    scale: float,
) -> Tensor:
    from kernels.indexer.triton_sparse import sparse_attention_triton

    return sparse_attention_triton(q, k_pool, v_pool, positions, page_table, cu_seqlens, seq_lens, page_size, scale)


def _selection_like(q: Tensor, weights: Optional[Tensor], block_keys: Tensor, *args: object) -> Tensor:
    """int32 [T, W]: W as ``kernels.indexer.reference.out_width`` (args: .., C, top_blocks, .., tail)."""
    block_size, top_blocks = int(args[2]), int(args[3])  # type: ignore[call-overload]
    tail = bool(args[6]) if len(args) > 6 else True
    width = top_blocks * block_size + (block_size - 1 if tail else 0)
    return q.new_empty((q.shape[0], width), dtype=torch.int32)


def _sparse_like(q: Tensor, k_pool: Tensor, v_pool: Tensor, *_: object) -> Tensor:
    return _like(q, q.shape[0], q.shape[1], v_pool.shape[-1])


indexer_select = _opaque("indexer_select", _indexer_select, (), _selection_like)
indexer_sparse = _opaque("indexer_sparse", _indexer_sparse, (), _sparse_like)
