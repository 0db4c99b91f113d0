"""The Mamba2 mixer's dims from the configs that name them ``mamba_*`` (Granite-4.0-H,
Bamba, Falcon-H1), and the checks those families share. Mamba2, Nemotron-H and Zamba2 name
the same dims differently and map them in their own files."""

from __future__ import annotations

from typing import Any

from workers.models.mamba2 import Mamba2Dims


def head_dim(cfg: Any) -> int:
    """The attention head dim: ``head_dim`` when the config has one, else hidden / heads."""
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def time_step_limit(cfg: Any) -> tuple[float, float]:
    limit = getattr(cfg, "time_step_limit", None)
    if limit is None:
        return (0.0, float("inf"))
    return (float(limit[0]), float(limit[1]))


def mamba_prefixed_dims(cfg: Any, **extra: Any) -> Mamba2Dims:
    """``mamba_n_heads``, ``mamba_d_head``, ``mamba_d_state``, ``mamba_n_groups``,
    ``mamba_d_conv``, ``mamba_conv_bias``, ``mamba_proj_bias``, ``mamba_chunk_size``,
    ``time_step_limit``, ``rms_norm_eps``; ``extra`` sets the family's other dims."""
    return Mamba2Dims(
        hidden_size=cfg.hidden_size,
        num_heads=cfg.mamba_n_heads,
        head_dim=cfg.mamba_d_head,
        state_size=cfg.mamba_d_state,
        num_groups=cfg.mamba_n_groups,
        conv_kernel=cfg.mamba_d_conv,
        conv_bias=bool(cfg.mamba_conv_bias),
        proj_bias=bool(cfg.mamba_proj_bias),
        chunk_size=cfg.mamba_chunk_size,
        dt_limit=time_step_limit(cfg),
        eps=cfg.rms_norm_eps,
        **extra,
    )


def check_mamba_dims(
    cfg: Any, dims: Mamba2Dims, d_inner: int, d_inner_name: str, act_field: str | None = "hidden_act"
) -> None:
    """ValueError unless the conv activation (``act_field``) is silu, heads x head dim is
    ``d_inner`` and the dims are valid."""
    if act_field is not None and getattr(cfg, act_field) != "silu":
        raise ValueError(
            f"{act_field}={getattr(cfg, act_field)!r} is not supported (it is the Mamba2 conv activation; only 'silu')"
        )
    if dims.d_inner != d_inner:
        raise ValueError(
            f"{dims.num_heads} heads * {dims.head_dim} head dim = {dims.d_inner} != {d_inner_name} = {d_inner}"
        )
    dims.validate()
