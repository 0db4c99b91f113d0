"""Seeded draws keyed by sequence position, so a seeded request can be resumed anywhere.

The noise that picks the token at sequence position P of a request seeded s (``nth_seed``
per choice) comes from a generator seeded ``position_seed(s, P)`` just before the draw, and
from nothing else: not the draws before it, not the batch, not speculation. A request resumed
as its prompt plus its first k outputs (same seed) puts output k at the same position P as an
undisturbed run, so it draws the same noise there and continues with the same tokens.

Every seeded draw is an exponential race (argmax p / E, E ~ Exp(1) per token): the target's
token at P, and an MTP draft for P drawn with the same noise (``workers/spec/drafter.py``).
A seeded verify then accepts a draft exactly when it equals the target's own draw at that
position (``workers/sampling/decide.py``), so speculation changes how fast, not what.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def position_seed(seed: int, position: int) -> int:
    """The generator seed of the draw at ``position`` of a request seeded ``seed``: mixed so
    that neighbouring seeds (the choices of one prompt) and positions share no stream; the
    high half folded into the low one because a CPU generator keeps only 32 bits."""
    x = _splitmix64(_splitmix64(seed & _MASK) ^ position)
    return x ^ (x >> 32)


@dataclass(frozen=True)
class SeededSeq:
    """A sampling sequence whose rows draw keyed noise (seeded and not greedy).

    Row r samples the token at ``position + r`` (a verify's row r scores draft r + 1); a
    chained verify's position is its least, moved on the forward thread by the drafts the
    verify before it accepted."""

    seq: int  # index among the step's sampling sequences
    position: int  # sequence position of the token its first row samples
    chained: bool = False


def keyed_noise(noise: torch.Tensor, gen: torch.Generator, key: int) -> torch.Tensor:
    """``noise`` filled with Exp(1) draws from ``gen`` re-seeded with ``key``; returned."""
    gen.manual_seed(key)
    return noise.exponential_(generator=gen)
