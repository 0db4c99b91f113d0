"""Decay factors exp(x) of the chunked scans' log-decays (x <= 0), fast on CPU.

The chunked forms (GDN, KDA, SSD) build exp(log_b_i - log_b_j) over a chunk, and with strong
decays (Qwen3-Next's g reaches -10 a token, -600 over a 64-token chunk) most of those
exponents fall below fp32's range. ATen's vectorised exp leaves its fast path for every vector
holding a lane whose result is not a normal float (-inf, and anything below ~-87.3): 470 us
instead of 11 us for an [8, 64, 64] block of such values, one thread. Its denormal results
then slow every product they enter (x86 takes a microcode assist per denormal operand).

``decay_exp`` returns exp(x) where x >= ``MIN_LOG`` and exactly 0 below. A factor below
e^-80 (1.8e-35) multiplies terms bounded by the l2-normalised keys and the state, so it
cannot change an fp32 sum holding any term above ~1e-28. Measured (one thread, Intel Xeon):
the GDN chunked form of 512 tokens, 8 heads of 32 x 32, g down to -12 a token: 15.2 -> 6.9
ms, and 300 tokens of 4 heads of 128 x 128: 19.0 -> 11.1 ms, outputs and states bitwise equal
to the plain exp; mild decays (g >= -0.5) the same time either way. The random bench models'
prefills show no change (their decays are mild); trained checkpoints' are not.
"""
from __future__ import annotations

from torch import Tensor

MIN_LOG = -80.0


def decay_exp(x: Tensor) -> Tensor:
    """exp(x) for x >= MIN_LOG, 0 below (and at -inf); a new tensor."""
    return x.clamp(min=MIN_LOG).exp_().masked_fill_(x < MIN_LOG, 0.0)
