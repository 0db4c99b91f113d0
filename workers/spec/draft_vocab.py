"""The tokens a drafter scores: every token, or a frequency-ranked subset of the vocabulary.

A draft's only use is to be verified, so the drafter may score fewer tokens than the target:
the chain's argmax (or sample) runs over the lm-head rows of the N most frequent tokens (Zhao
et al., "FR-Spec"; SGLang's ``speculative_token_map`` for EAGLE). Each chained draft then
reads N rows of the lm-head instead of V, which on a small model is a large share of the
chain's bytes (BENCHMARKS.md, the draft vocabulary). Verification still
scores every token, so greedy output is unchanged; a sampled draft's distribution q is zero
outside the subset, which rejection sampling accepts as any q (``workers/spec/acceptance.py``).

The subset lives beside the model, ``draft_vocab.json`` (``{"token_ids": [...]}``, most
frequent first, plus how it was made), and ``spec.draft_vocab`` picks it (configs/schema.py);
``python -m tools.training.make_draft_vocab`` writes one from a model's training text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

FILE_NAME = "draft_vocab.json"


@dataclass(frozen=True)
class DraftVocab:
    """``token_ids`` [N] int64 (None: every token) and ``weight`` [N, H], the lm-head's rows
    of those tokens (copied once: a drafting step reads N rows, not V)."""

    token_ids: Tensor | None = None
    weight: Tensor | None = None

    @property
    def size(self) -> int | None:
        return None if self.token_ids is None else int(self.token_ids.shape[0])

    def logits(self, target: torch.nn.Module, hidden: Tensor) -> Tensor:
        """[B, N] fp32 logits of the drafted-from tokens (N = V without a subset)."""
        if self.weight is None:
            return target.compute_logits(hidden)
        return target.logits_from(hidden, self.weight)

    def tokens(self, index: Tensor) -> Tensor:
        """Token ids of positions in ``logits``' last dim."""
        return index if self.token_ids is None else self.token_ids[index]

    def subset(self, row: Tensor) -> Tensor:
        """A [V] row over every token -> [N] over the drafted-from ones."""
        return row if self.token_ids is None else row[self.token_ids]

    def full(self, probs: Tensor, vocab_size: int) -> Tensor:
        """[B, N] probabilities over the subset -> [B, V] (zero outside it)."""
        if self.token_ids is None:
            return probs
        out = probs.new_zeros(*probs.shape[:-1], vocab_size)
        return out.index_copy_(-1, self.token_ids, probs)


def resolve_path(setting: str | None, model_dir: Path) -> Path | None:
    """The file ``spec.draft_vocab`` names: None for every token."""
    if setting is None:
        return None
    if setting == "auto":
        path = model_dir / FILE_NAME
        return path if path.is_file() else None
    path = Path(setting)
    if not path.is_file():
        raise ValueError(f"spec.draft_vocab: no file at {setting!r}")
    return path


def read_token_ids(path: Path, vocab_size: int) -> list[int]:
    """The token ids of a draft-vocabulary file, checked: a non-empty list of distinct ids
    in [0, vocab_size)."""
    try:
        ids = json.loads(path.read_text())["token_ids"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"spec.draft_vocab: {path} is not a JSON object with a token_ids list: {exc}") from None
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError(f"spec.draft_vocab: {path}: token_ids must be a non-empty list of integers")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"spec.draft_vocab: {path}: token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
    if len(set(ids)) != len(ids):
        raise ValueError(f"spec.draft_vocab: {path}: {len(ids) - len(set(ids))} repeated token ids")
    return ids


def load_draft_vocab(setting: str | None, model_dir: Path, target: torch.nn.Module) -> DraftVocab:
    """The drafter's vocabulary for ``spec.draft_vocab`` over ``target``'s lm-head."""
    path = resolve_path(setting, model_dir)
    if path is None:
        return DraftVocab()
    weight = target.lm_head_weight()
    ids = torch.tensor(read_token_ids(path, int(weight.shape[0])), dtype=torch.int64, device=weight.device)
    return DraftVocab(ids, weight.detach()[ids].clone())
