"""fp32 linear layers on CPU through oneDNN where it beats MKL's sgemm (the projections call
it through ``kernels/dense.py``, which takes products of a few rows to its own kernel first).

torch's CPU build runs ``F.linear`` in fp32 on MKL's sgemm. On an AMD CPU that sgemm is well
below what oneDNN's ``mkldnn::_linear_pointwise`` reaches on the same plain weight (no
packing, no copy kept) from a few dozen rows up, so a prefill's projections and expert MLPs
take about half the time there (BENCHMARKS.md). oneDNN pays a fixed cost per call, so it
loses on small products; ``use_onednn`` takes it from ``MIN_ROWS`` rows and ``MIN_MACS``
multiply-adds up (the measured crossovers). On an Intel CPU MKL is the faster
(``prefers_onednn`` is False there). The choice is per machine (the CPU's vendor), never per
call, so a machine computes a shape one way.

On a given machine the choice depends on shapes only, so it is the same wherever the same
shapes run (the C++ expert loop in ``kernels/native_ops.py`` applies the same rule with the
same constants). A row does not depend on the other rows of its call (a row computed alone
equals the same row inside a larger batch): oneDNN's from ``MIN_ROWS``, MKL's from 16 rows on
(below, a small-M kernel sums in another order), as ``tests/kernels/test_cpu_linear.py``
checks on the machine it runs on. Under ``torch.compile`` (a traced step) and wherever
autograd needs the product, ``F.linear`` runs: inductor picks its own kernels (packed oneDNN
weights with ``compile.pack_weights``).

oneDNN keeps what it builds for a shape in two caches (ideep's ``LRU_CACHE_CAPACITY`` and
oneDNN's ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, 1,024 entries each by default, read at the
first oneDNN call), ~0.6-1.8 MiB an entry on a 15M model and more at larger rows x features.
A server's prefills come in ever new row counts, so a replica's RSS grew by ~160 MiB in ten
minutes of mixed load towards GiBs; ``bound_caches`` (at import, before any oneDNN call in a
process that runs this module's linear) caps both at ``ONEDNN_CACHE_CAPACITY`` entries unless
the environment already sets them. Within a step every layer shares the step's row count,
so a few row counts' entries cover it.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import Tensor

MIN_ROWS = 4
MIN_MACS = 1 << 21
ONEDNN_CACHE_CAPACITY = 64
CACHE_VARS = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")


def bound_caches() -> None:
    """Cap oneDNN's shape caches (see the module docstring); a value already set wins."""
    for name in CACHE_VARS:
        os.environ.setdefault(name, str(ONEDNN_CACHE_CAPACITY))


bound_caches()


@functools.cache
def available() -> bool:
    """Whether this torch build has oneDNN and its linear op."""
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def prefers_onednn() -> bool:
    """Whether this machine takes oneDNN at all: not on an Intel CPU, where MKL is the faster
    (see the module docstring); an unknown vendor keeps oneDNN."""
    return available() and cpu_vendor() != "GenuineIntel"


def cpu_vendor() -> str:
    """``vendor_id`` of /proc/cpuinfo ("GenuineIntel", "AuthenticAMD"), "" where unknown."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def use_onednn(rows: int, in_features: int, out_features: int) -> bool:
    """The shape rule (see the module docstring): rows x in x out multiply-adds, on a machine
    that prefers oneDNN."""
    return prefers_onednn() and rows >= MIN_ROWS and rows * in_features * out_features >= MIN_MACS


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``, through oneDNN where ``use_onednn`` says so (fp32, CPU,
    no autograd, not traced)."""
    if _eligible(x, weight, bias) and use_onednn(x.numel() // max(x.shape[-1], 1), weight.shape[1], weight.shape[0]):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _eligible(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    if x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32:
        return False
    if torch.compiler.is_compiling() or not available() or not weight.is_contiguous() or weight.dim() != 2:
        return False
    if bias is not None and bias.dtype != torch.float32:
        return False
    return not (
        torch.is_grad_enabled()
        and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
    )
