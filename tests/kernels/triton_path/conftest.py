"""The Triton path's tests: real kernels on a GPU, the Triton interpreter on CPU.

Without CUDA this sets ``TRITON_INTERPRET=1`` at collection time. Triton decides at
decoration time whether a ``@triton.jit`` function is interpreted, and that includes its own
standard library (``tl.zeros`` ...), decorated when ``triton`` is first imported. In a full
``pytest`` run, ``triton`` has usually been imported already, without the variable:
``torch._dynamo`` imports it, and transformers imports ``torch._dynamo``. So the pure-Python
``triton`` modules (not its C extension) and any Triton kernel module of ``kernels`` are
dropped from ``sys.modules``; the ops import their kernel modules lazily, so the next import
brings a fresh, interpreted ``triton`` with them. Modules that kept references to the old
``triton`` objects (torch's) keep them; nothing on a CPU machine launches through those.

Shapes stay tiny (T <= 64, a few heads, K, V <= 16): the interpreter runs every program
instance in Python, so the whole folder takes about a minute on two cores.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available()


def _interpreted_triton_loaded() -> bool:
    triton = sys.modules.get("triton")
    zeros = getattr(getattr(getattr(triton, "language", None), "standard", None), "zeros", None)
    return type(zeros).__name__ == "InterpretedFunction"


if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
    stale = [n for n in sys.modules if n.startswith("kernels.") and ".triton_" in n]
    if "triton" in sys.modules and not _interpreted_triton_loaded():
        stale += [
            n for n in sys.modules if (n == "triton" or n.startswith("triton.")) and not n.startswith("triton._C")
        ]
    for _name in stale:
        del sys.modules[_name]

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
# The interpreter does fp32 dots exactly; on a GPU fp32 tl.dot rounds operands to tf32.
TOL = 5e-3 if ON_GPU else 1e-4


@pytest.fixture(scope="session")
def device() -> torch.device:
    return DEVICE


@pytest.fixture(scope="session")
def tol() -> float:
    return TOL
