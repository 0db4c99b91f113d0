"""Decay factors exp(x) of the chunked scans' log-decays (x <= 0), fast on CPU.

The chunked forms (GDN, KDA, SSD) build exp(log_b_i - log_b_j) over a chunk, and with strong
decays (Qwen3-Next's g reaches -10 a token, -600 over a 64-token chunk) most of those
exponents fall below fp32's range. ATen's vectorised exp leaves its fast path for every vector
holding a lane whose result is not a normal float (-inf, and anything below ~-87.3), many
times slower; its denormal results then slow every product they enter (x86 takes a microcode
assist per denormal operand).

``decay_exp`` returns exp(x) where x >= ``MIN_LOG`` and exactly 0 below. A factor below
e^-80 (1.8e-35) multiplies terms bounded by the l2-normalised keys and the state, so it
cannot change an fp32 sum holding any term above ~1e-28: outputs and states are bitwise
those of the plain exp, and strong decays (trained checkpoints') run much faster.
"""

from __future__ import annotations

from torch import Tensor

MIN_LOG = -80.0


def decay_exp(x: Tensor) -> Tensor:
    """exp(x) for x >= MIN_LOG, 0 below (and at -inf); a new tensor."""
    return x.clamp(min=MIN_LOG).exp_().masked_fill_(x < MIN_LOG, 0.0)
