"""A checkpoint as it travels through the cluster store: state + the KV of its path.

``CheckpointPayload`` is plain data (numpy byte arrays and metadata), cheap to put into
Ray's object store and read back zero-copy. It carries everything a fetching replica needs
to refuse what does not fit before anything is written (``payload_problem``): the depth
and page size, the token path and its prefix hash (recomputed, so the key, the hash and
the tokens must agree), the model fingerprint (same weights and dtype), and per tensor the
``[layers, *shape]`` and dtype of the fetching replica's own pools.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from workers.cache.prefix_hash import prefix_hash
from workers.quantization.scheme import MODELOPT_FILE

# side -> kind -> name -> (shape, dtype)
Layout = dict[str, dict[str, dict[str, tuple[tuple[int, ...], str]]]]


@dataclass(frozen=True)
class CheckpointPayload:
    token_ids: tuple[int, ...]
    page_size: int
    prefix_hash: bytes
    fingerprint: str
    # side ("slots": one entry; "kv": one row per token of the path) -> kind -> tensor name ->
    # (entry shape [layers, *shape], dtype name, raw bytes of [layers, entries, *shape]).
    data: dict[str, dict[str, dict[str, tuple[tuple[int, ...], str, np.ndarray]]]]

    @property
    def depth(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        return sum(raw.nbytes for side in self.data.values() for kind in side.values() for _, _, raw in kind.values())

    @classmethod
    def build(
        cls,
        token_ids: tuple[int, ...],
        page_size: int,
        digest: bytes,
        fingerprint: str,
        entry: dict[str, dict[str, dict[str, torch.Tensor]]],
    ) -> CheckpointPayload:
        """From ``TierStorage.read_host`` tensors ``[layers, entries, *shape]``."""
        data = {
            side: {kind: {name: _encode(t) for name, t in named.items()} for kind, named in kinds.items()}
            for side, kinds in entry.items()
        }
        return cls(token_ids, page_size, digest, fingerprint, data)

    def tensors(self) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
        return {
            side: {kind: {name: _decode(*v) for name, v in named.items()} for kind, named in kinds.items()}
            for side, kinds in self.data.items()
        }


def _encode(t: torch.Tensor) -> tuple[tuple[int, ...], str, np.ndarray]:
    entry = (int(t.shape[0]), *(int(d) for d in t.shape[2:]))
    raw = t.contiguous().view(torch.uint8).numpy().copy() if t.numel() else np.zeros(0, np.uint8)
    return entry, str(t.dtype).removeprefix("torch."), raw.reshape(-1)


def _decode(entry: tuple[int, ...], dtype: str, raw: np.ndarray) -> torch.Tensor:
    dt = getattr(torch, dtype)
    flat = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True)).view(dt)
    per_entry = int(np.prod(entry))
    n = flat.numel() // per_entry if per_entry else 0
    return flat.reshape(entry[0], n, *entry[1:])


def payload_problem(
    payload: Any, page_size: int, fingerprint: str, layout: Layout, expected_hash: bytes | None = None
) -> str | None:
    """Why ``payload`` may not be promoted on this replica, or None when it may."""
    if not isinstance(payload, CheckpointPayload):
        return f"not a checkpoint payload: {type(payload).__name__}"
    d = payload.depth
    if payload.page_size != page_size:
        return f"page size {payload.page_size}, this replica uses {page_size}"
    if d == 0 or d % page_size:
        return f"depth {d} is not a positive multiple of page size {page_size}"
    if prefix_hash(payload.token_ids, page_size) != payload.prefix_hash:
        return f"prefix hash does not match the {d} tokens it carries"
    if expected_hash is not None and payload.prefix_hash != expected_hash:
        return "prefix hash is not the key it was fetched under"
    if payload.fingerprint != fingerprint:
        return f"model fingerprint {payload.fingerprint[:12]} != this replica's {fingerprint[:12]}"
    if set(payload.data) != set(layout):
        return f"sides {sorted(payload.data)} != {sorted(layout)}"
    for side, kinds in layout.items():
        entries = 1 if side == "slots" else d
        got = {k: {n: v[:2] for n, v in named.items()} for k, named in payload.data[side].items()}
        if got != kinds:
            return f"{side} layout {got} != this replica's {kinds}"
        for kind, named in payload.data[side].items():
            for name, (entry, dtype, raw) in named.items():
                itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
                want = int(np.prod(entry)) * entries * itemsize
                if raw.nbytes != want:
                    return f"{side}/{kind}/{name}: {raw.nbytes} bytes, expected {want} for {entries} entries"
    return None


def model_fingerprint(model_dir: str | Path, dtype: torch.dtype) -> str:
    """Names the weights a state was computed with: config.json (its ``quantization_config``
    included), ModelOpt's ``hf_quant_config.json`` where there is one, the dtype, and per
    safetensors file its size and first and last MiB (distinct random seeds differ there)."""
    root = Path(model_dir)
    h = hashlib.blake2b(digest_size=16)
    h.update(str(dtype).encode())
    config = root / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    quant = root / MODELOPT_FILE  # a quantization config beside config.json
    if quant.is_file():
        h.update(quant.name.encode() + quant.read_bytes())
    for f in sorted(root.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f.name.encode() + size.to_bytes(8, "little"))
        with f.open("rb") as fh:
            h.update(fh.read(1 << 20))
            if size > 2 << 20:
                fh.seek(size - (1 << 20))
                h.update(fh.read())
    return h.hexdigest()
