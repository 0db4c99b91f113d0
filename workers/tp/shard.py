"""Tensor parallelism as a transform over a built, loaded model (gpt-fast style).

``shard_model(model, comm)`` narrows, in place, every layer that TP splits and puts one
all-reduce after it, so each rank holds its share of the heads and ends every layer with
the full hidden state:

- attention: q/k/v by heads (column), ``o_proj`` by heads (row);
- Gated DeltaNet: by key-head groups (``in_proj_qkvz`` / ``in_proj_ba`` rows, or Qwen3.5's
  ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a`` rows, conv channels of q, k,
  v, ``A_log`` / ``dt_bias`` of the value heads), ``out_proj`` (row);
- Mamba2: heads and B/C groups (see ``mamba_groups``), conv channels follow x/B/C;
- Mamba1: d_inner channels (``x_proj``'s partial output is all-reduced inside the mixer);
- short conv (LFM2): its channels (``in_proj``'s B / C / x rows, conv, ``out_proj``);
- dense MLP and MoE: each expert's intermediate dim (and the shared expert's); the
  router, every norm, embeddings and ``lm_head`` are replicated;
- KDA, MLA, lightning attention and OLMo's attention / GDN: ``shard_mixers``.

The all-reduce is a forward hook on the sharded layer (one per mixer, per MLP, per MoE
including its shared expert). A family's own layer kind shards itself: a module with a
``tp_shard(rank, world, comm)`` method (and ``tp_checks()``, the counts a split must divide)
is sharded by it and gets the same hook. A module reached twice (Zamba2's shared block) is
sharded once. ``shard_module`` does the same for any module tree, e.g. the MTP head's layer.
``model.cache_spec()`` afterwards describes this rank's pool shard: it reads the narrowed
dims of the stateful modules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from workers.models.gated_deltanet import GatedDeltaNet
from workers.models.layers import Attention, DenseMLP
from workers.models.mamba1 import Mamba1Mixer
from workers.models.mamba2 import Mamba2Mixer
from workers.models.moe import SparseMoE
from workers.models.short_conv import ShortConv
from workers.tp.comm import Comm
from workers.tp.shard_layers import (
    mamba_groups,
    part,
    shard_attention,
    shard_gdn,
    shard_mamba1,
    shard_mamba2,
    shard_mlp,
    shard_moe,
    shard_short_conv,
)
from workers.tp.shard_mixers import CHECKS, SHARDERS

_SHARDED = "_tp_sharded"


def _all_reduce_hook(comm: Comm) -> Callable[..., torch.Tensor]:
    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return comm.all_reduce(output.contiguous())

    return hook


def _shard_one(module: nn.Module, comm: Comm) -> bool:
    rank, world = comm.rank, comm.world_size
    custom = getattr(module, "tp_shard", None)
    mixer = SHARDERS.get(type(module))  # exact classes: some subclass the shared kinds
    if custom is not None:
        custom(rank, world, comm)
    elif mixer is not None:
        mixer(module, rank, world, comm)
    elif isinstance(module, Attention):
        shard_attention(module, rank, world)
    elif isinstance(module, GatedDeltaNet):
        shard_gdn(module, rank, world)
    elif isinstance(module, Mamba2Mixer):
        shard_mamba2(module, rank, world, comm)
    elif isinstance(module, Mamba1Mixer):
        shard_mamba1(module, rank, world, comm)
    elif isinstance(module, ShortConv):
        shard_short_conv(module, rank, world)
    elif isinstance(module, SparseMoE):
        shard_moe(module, rank, world)
    elif isinstance(module, DenseMLP):
        shard_mlp(module, rank, world)
    else:
        return False
    return True


def shard_module(root: nn.Module, comm: Comm) -> None:
    """Shard every TP layer under ``root`` (outermost first; a MoE takes its shared expert)."""
    if comm.world_size == 1:
        return
    if getattr(root, _SHARDED, False):
        raise ValueError("module is already sharded")
    errors = tp_errors(root, comm.world_size)
    if errors:
        raise ValueError(_describe(errors, comm.world_size))

    seen: set[int] = set()

    def visit(module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        if _shard_one(module, comm):
            module.register_forward_hook(_all_reduce_hook(comm))
            return
        for child in module.children():
            visit(child)

    visit(root)
    setattr(root, _SHARDED, True)


def shard_model(model: nn.Module, comm: Comm) -> None:
    """Shard a loaded ``HybridForCausalLM`` for ``comm``'s rank; see the module docstring."""
    shard_module(model, comm)


def tp_errors(root: nn.Module, world: int) -> list[str]:
    """Every count under ``root`` that a ``world``-way split cannot divide (config names)."""
    checks: list[tuple[int, str]] = []
    groups: set[int] = set()
    shared = {id(m.shared_expert) for m in root.modules() if isinstance(m, SparseMoE)}
    for m in root.modules():
        custom = getattr(m, "tp_checks", None)
        mixer = CHECKS.get(type(m))
        if custom is not None:
            checks += custom()
        elif mixer is not None:
            checks += mixer(m)
        elif isinstance(m, Attention):
            checks += [(m.dims.num_heads, "num_attention_heads"), (m.dims.num_kv_heads, "num_key_value_heads")]
        elif isinstance(m, GatedDeltaNet):
            checks.append((m.dims.num_k_heads, "linear_num_key_heads"))
        elif isinstance(m, Mamba2Mixer):
            checks.append((m.dims.num_heads, "mamba_n_heads"))
            groups.add(m.dims.num_groups)
        elif isinstance(m, Mamba1Mixer):
            checks.append((m.dims.d_inner, "mamba_expand * hidden_size"))
        elif isinstance(m, ShortConv):
            checks.append((m.dims.channels, "hidden_size (short conv channels)"))
        elif isinstance(m, SparseMoE):
            checks.append((m.dims.intermediate_size, "expert intermediate size"))
            if m.dims.shared_intermediate_size:
                checks.append((m.dims.shared_intermediate_size, "shared_expert_intermediate_size"))
        elif isinstance(m, DenseMLP) and id(m) not in shared:
            checks.append((m.intermediate_size, "MLP intermediate_size"))
    errors = list(dict.fromkeys(f"{name}={n}" for n, name in checks if n % world))
    for g in sorted(groups):
        try:
            mamba_groups(g, 0, world)
        except ValueError:
            errors.append(f"mamba_n_groups={g} (neither divides the other)")
    return errors


def _describe(errors: list[str], world: int) -> str:
    return (
        f"tensor_parallel_size={world} does not divide the model's "
        + ", ".join(errors)
        + "; choose a size that divides every head count and intermediate size"
    )


def validate_tp(hf_config: Any, world: int) -> None:
    """Raise ValueError when ``world`` ranks cannot split this model (built on meta, no weights)."""
    if world == 1:
        return
    from workers.models import get_model_class

    model = get_model_class(hf_config.architectures[0])(hf_config, torch.float32, "meta")
    errors = tp_errors(model, world)
    if errors:
        raise ValueError(_describe(errors, world))


__all__ = ["shard_model", "shard_module", "tp_errors", "validate_tp", "part"]
