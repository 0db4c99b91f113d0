"""Mapping checkpoint tensor names onto model parameters, strictly.

A model describes where every checkpoint tensor goes as a ``{hf_name: WeightTarget}`` dict.
A target usually is one whole parameter; a fused checkpoint tensor (Granite's expert
``input_linear`` = gate ++ up) is split along one dim into several parameters, and a
per-expert tensor lands in one row of a stacked ``[E, ...]`` parameter.

``load_named_weights`` enforces the rules of ``model.load_weights``: every required target
loaded (else ValueError naming the missing ones), shapes equal (else ValueError naming the
tensor and both shapes), no unknown tensor (else ValueError naming it) except ``mtp.*``,
which is returned aside for the MTP head.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import NamedTuple

import torch
from torch import nn

MTP_PREFIX = "mtp."


class WeightTarget(NamedTuple):
    """Where one checkpoint tensor goes.

    ``parts[i] = (dst, dim)``: consecutive slices of the source along ``dim`` are copied into
    each ``dst`` in order (one part = the whole tensor). ``required=False`` marks an alias
    that may be absent (a tied ``lm_head.weight``).
    """

    shape: tuple[int, ...]
    parts: tuple[tuple[torch.Tensor, int], ...]
    required: bool = True


def whole(dst: torch.Tensor, required: bool = True) -> WeightTarget:
    return WeightTarget(tuple(dst.shape), ((dst, 0),), required)


def split(dim: int, *dsts: torch.Tensor) -> WeightTarget:
    """One source tensor = ``cat(dsts, dim)``."""
    shape = list(dsts[0].shape)
    shape[dim] = sum(d.shape[dim] for d in dsts)
    return WeightTarget(tuple(shape), tuple((d, dim) for d in dsts))


def module_targets(module: nn.Module, prefix: str = "") -> dict[str, WeightTarget]:
    """Targets of a module tree: each parameter under its own dotted name.

    A submodule with a ``weight_targets(prefix)`` method describes itself (used where the
    checkpoint layout differs from the parameter layout, e.g. stacked experts).
    """
    custom = getattr(module, "weight_targets", None)
    if custom is not None:
        return custom(prefix)
    targets = {prefix + name: whole(p) for name, p in module.named_parameters(recurse=False)}
    for name, child in module.named_children():
        targets.update(module_targets(child, f"{prefix}{name}."))
    return targets


def _copy_into(name: str, target: WeightTarget, tensor: torch.Tensor) -> None:
    if tuple(tensor.shape) != target.shape:
        raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                         f"the model expects {target.shape}")
    offsets = [0] * len(target.shape)
    for dst, dim in target.parts:
        if len(target.parts) == 1:
            src = tensor
        else:
            src = tensor.narrow(dim, offsets[dim], dst.shape[dim])
            offsets[dim] += dst.shape[dim]
        with torch.no_grad():
            dst.copy_(src)


def load_named_weights(targets: Mapping[str, WeightTarget],
                       weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Copy ``weights`` into ``targets``; returns the ``mtp.*`` tensors kept aside."""
    loaded: set[str] = set()
    mtp: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.startswith(MTP_PREFIX):
            mtp[name] = tensor
            continue
        target = targets.get(name)
        if target is None:
            raise ValueError(f"unexpected tensor {name!r} in the checkpoint "
                             f"(shape {tuple(tensor.shape)}); the model has no such weight")
        _copy_into(name, target, tensor)
        loaded.add(name)
    missing = sorted(n for n, t in targets.items() if t.required and n not in loaded)
    if missing:
        shown = ", ".join(repr(n) for n in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {shown}{more}")
    return mtp


QKV_CONVS = ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")


def merge_split_tensors(weights: Iterable[tuple[str, torch.Tensor]], parts: tuple[str, ...] = QKV_CONVS,
                        merged: str = "conv1d.weight") -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with, per module, the tensors ``<module>.<part>`` replaced by one
    ``<module>.<merged>`` = cat(parts in order, dim 0), as transformers' loader concatenates
    them. The parts' lengths are not checked, only their sum (by the merged target): the
    released checkpoints split q | k | v at their widths, transformers' ``save_pretrained``
    into equal thirds. A module missing some of its parts raises ValueError naming them."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        part = next((p for p in parts if name.endswith("." + p)), None)
        if part is None:
            yield name, tensor
            continue
        module = name[: -len(part)]
        group = pending.setdefault(module, {})
        group[part] = tensor
        if len(group) == len(parts):
            yield module + merged, torch.cat([group[p] for p in parts], dim=0)
            del pending[module]
    if pending:
        missing = sorted(m + p for m, g in pending.items() for p in parts if p not in g)
        raise ValueError(f"checkpoint is missing {missing[:8]}: the other parts of "
                         f"{sorted(m + merged for m in pending)[:4]} are there")
