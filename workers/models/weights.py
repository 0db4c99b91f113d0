"""Mapping checkpoint tensor names onto model parameters, strictly.

A model describes where every checkpoint tensor goes as a ``{hf_name: WeightTarget}`` dict.
A target usually is one whole parameter; a fused checkpoint tensor (Granite's expert
``input_linear`` = gate ++ up) is split along one dim into several parameters, and a
per-expert tensor lands in one row of a stacked ``[E, ...]`` parameter.

``load_named_weights`` enforces the rules of ``model.load_weights``: every required target
loaded (else ValueError naming the missing ones), shapes equal (else ValueError naming the
tensor and both shapes), no unknown tensor (else ValueError naming it) except ``mtp.*``,
which is returned aside for the MTP head.

Tied tensors (an optional alias writing the parameters of a required target: a tied
``lm_head.weight``, Zamba2's repeated shared blocks) follow transformers' rule for a tie the
checkpoint may not honour: the alias alone fills the parameters (and counts for the target);
both present and equal are one tensor; both present and different are refused with a
ValueError naming both (transformers unties them, which a tied model here cannot).
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


def shared_child_targets(module: nn.Module, prefix: str, shared: str, first_use: bool) -> dict[str, WeightTarget]:
    """Targets of a layer whose child ``shared`` is a block other layers hold too (Zamba's and
    Zamba2's shared transformer): its names are required under its first user only; under
    the others (tied copies) they are accepted when present, not needed."""
    targets = {prefix + name: whole(p) for name, p in module.named_parameters(recurse=False)}
    for name, child in module.named_children():
        sub = module_targets(child, f"{prefix}{name}.")
        if name == shared and not first_use:
            sub = {key: t._replace(required=False) for key, t in sub.items()}
        targets.update(sub)
    return targets


def _copy_into(name: str, target: WeightTarget, tensor: torch.Tensor) -> None:
    if tuple(tensor.shape) != target.shape:
        raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {target.shape}")
    offsets = [0] * len(target.shape)
    for dst, dim in target.parts:
        if len(target.parts) == 1:
            src = tensor
        else:
            src = tensor.narrow(dim, offsets[dim], dst.shape[dim])
            offsets[dim] += dst.shape[dim]
        with torch.no_grad():
            dst.copy_(src)


Key = tuple[object, ...]


def _dst_key(target: WeightTarget) -> Key:
    """What ``target`` writes: its parts' tensors (by memory; by object on the meta device)."""
    return tuple(
        (id(d) if d.is_meta else (d.device, d.data_ptr(), tuple(d.shape), d.stride()), dim) for d, dim in target.parts
    )


class _Aliases:
    """Optional targets that write a required target's parameters (see the module docstring),
    as the checkpoint streams: each is checked against its owner once the owner is loaded and
    held until then; those whose owners never come fill the parameters at ``finish``."""

    def __init__(self, targets: Mapping[str, WeightTarget]) -> None:
        self.targets = targets
        self.owners: dict[Key, list[str]] = {}
        for name, target in targets.items():
            if target.required:
                self.owners.setdefault(_dst_key(target), []).append(name)
        self.loaded_owner: dict[Key, str] = {}
        self.pending: dict[Key, list[tuple[str, torch.Tensor]]] = {}

    def owner_loaded(self, name: str) -> None:
        key = _dst_key(self.targets[name])
        self.loaded_owner.setdefault(key, name)
        for alias, tensor in self.pending.pop(key, []):
            self._check(alias, tensor, name)

    def take(self, name: str, tensor: torch.Tensor) -> bool:
        """An optional target's tensor; False (not taken) where no required target owns its
        parameters (it is then simply loaded)."""
        key = _dst_key(self.targets[name])
        if key not in self.owners:
            return False
        owner = self.loaded_owner.get(key)
        if owner is None:
            self.pending.setdefault(key, []).append((name, tensor))
        else:
            self._check(name, tensor, owner)
        return True

    def finish(self) -> set[str]:
        """Load the aliases held for owners that never came; -> those owners' names."""
        filled: set[str] = set()
        for key, held in self.pending.items():
            (first, tensor), rest = held[0], held[1:]
            _copy_into(first, self.targets[first], tensor)
            for alias, other in rest:
                self._check(alias, other, first)
            filled.update(self.owners[key])
        return filled

    def _check(self, name: str, tensor: torch.Tensor, owner: str) -> None:
        parts = [d for d, _ in self.targets[name].parts]
        current = parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.targets[name].parts[0][1])
        if not torch.equal(current, tensor.to(current)):
            raise ValueError(
                f"the checkpoint has {owner!r} and {name!r}, which the config ties "
                "(tie_word_embeddings), with different values: transformers serves them "
                "untied; set tie_word_embeddings to false to serve this checkpoint"
            )


def load_named_weights(
    targets: Mapping[str, WeightTarget], weights: Iterable[tuple[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """Copy ``weights`` into ``targets``; returns the ``mtp.*`` tensors kept aside."""
    loaded: set[str] = set()
    mtp: dict[str, torch.Tensor] = {}
    aliases = _Aliases(targets)
    for name, tensor in weights:
        if name.startswith(MTP_PREFIX):
            mtp[name] = tensor
            continue
        target = targets.get(name)
        if target is None:
            raise ValueError(
                f"unexpected tensor {name!r} in the checkpoint "
                f"(shape {tuple(tensor.shape)}); the model has no such weight"
            )
        shape_ok = tuple(tensor.shape) == target.shape
        if target.required or not shape_ok or not aliases.take(name, tensor):
            _copy_into(name, target, tensor)  # a wrong shape raises, naming both
            if target.required:
                aliases.owner_loaded(name)
        loaded.add(name)
    loaded |= aliases.finish()
    missing = sorted(n for n, t in targets.items() if t.required and n not in loaded)
    if missing:
        shown = ", ".join(repr(n) for n in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {shown}{more}")
    return mtp


QKV_CONVS = ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")


def merge_split_tensors(
    weights: Iterable[tuple[str, torch.Tensor]], parts: tuple[str, ...] = QKV_CONVS, merged: str = "conv1d.weight"
) -> Iterator[tuple[str, torch.Tensor]]:
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
        raise ValueError(
            f"checkpoint is missing {missing[:8]}: the other parts of "
            f"{sorted(m + merged for m in pending)[:4]} are there"
        )
