"""``kernels/cpu_linear.py``: oneDNN where the shape rule says so, ``F.linear`` elsewhere."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_linear

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="this torch build has no oneDNN")


def _onednn(x, w, b=None):
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


@pytest.mark.parametrize(
    "rows, k, m",
    [
        (1, 256, 768),
        (3, 2048, 4096),
        (8, 256, 512),
        (128, 256, 8),
        (16, 256, 512),
        (4, 2048, 4096),
        (300, 256, 768),
        (1024, 256, 8),
    ],
)
def test_the_rule_picks_the_kernel_and_both_agree_with_aten(rows, k, m):
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(m, k, generator=gen)
    b = torch.randn(m, generator=gen)
    onednn = cpu_linear.prefers_onednn() and rows >= 4 and rows * k * m >= 1 << 21
    assert cpu_linear.use_onednn(rows, k, m) is onednn
    got = cpu_linear.linear(x, w, b)
    assert torch.equal(got, _onednn(x, w, b) if onednn else F.linear(x, w, b))
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("k, m", [(256, 768), (512, 256), (1024, 1024)])
def test_a_row_does_not_depend_on_the_other_rows_of_its_call(k, m):
    """What prefix caching and chunked prefill rely on: a prompt's rows computed in any split
    (oneDNN from its MIN_ROWS, MKL from 16 rows: what this machine's library does)."""
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(1000, k, generator=gen), torch.randn(m, k, generator=gen)
    whole = cpu_linear.linear(x, w)
    for lo, hi in ((0, 64), (37, 337), (500, 1000), (999, 1000 - 0), (100, 116), (3, 7)):
        if cpu_linear.use_onednn(hi - lo, k, m) or (not cpu_linear.prefers_onednn() and hi - lo >= 16):
            assert torch.equal(cpu_linear.linear(x[lo:hi], w), whole[lo:hi]), (lo, hi)


def test_the_vendor_decides_the_library():
    assert cpu_linear.prefers_onednn() is (cpu_linear.available() and cpu_linear.cpu_vendor() != "GenuineIntel")


def test_autograd_other_dtypes_and_traced_steps_keep_f_linear():
    w = torch.randn(512, 256, requires_grad=True)
    x = torch.randn(64, 256)
    y = cpu_linear.linear(x, w)
    assert y.grad_fn is not None and torch.equal(y, F.linear(x, w))
    xb, wb = x.bfloat16(), w.detach().bfloat16()
    assert torch.equal(cpu_linear.linear(xb, wb), F.linear(xb, wb))
    graphs = []

    def backend(gm, _inputs):
        graphs.append(str(gm.graph))
        return gm

    traced = torch.compile(lambda a, b: cpu_linear.linear(a, b), backend=backend, fullgraph=True)
    with torch.inference_mode():
        traced(x, w.detach())
    assert graphs and "mkldnn" not in graphs[0] and "linear" in graphs[0]


_RSS_PROBE = """
import os, sys
{prelude}
import torch
from kernels import cpu_linear
torch.set_num_threads(1)
def rss():
    return int([l for l in open("/proc/self/status") if l.startswith("VmRSS")][0].split()[1]) // 1024
weights = [torch.randn(768, 256), torch.randn(512, 256)]
for rows in range(64, 96):
    for w in weights: cpu_linear.linear(torch.randn(rows, 256), w)
before = rss()
for rows in range(96, 416):                 # 640 new (rows, weight) shapes
    for w in weights: cpu_linear.linear(torch.randn(rows, 256), w)
print(rss() - before, *(os.environ.get(n) for n in cpu_linear.CACHE_VARS))
"""


def _probe(prelude: str = "") -> list[str]:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in __import__("os").environ.items() if k not in cpu_linear.CACHE_VARS}
    done = subprocess.run(
        [sys.executable, "-c", _RSS_PROBE.format(prelude=prelude)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout.split()


@pytest.mark.skipif(not cpu_linear.available(), reason="no oneDNN in this torch build")
def test_new_row_counts_do_not_grow_memory_without_bound():
    """A server's prefills come in ever new row counts: oneDNN's shape caches stay capped
    (640 new shapes: ~400 MiB with the default 1,024-entry caches, ~30 capped)."""
    grown, *caps = _probe()
    assert caps == [str(cpu_linear.ONEDNN_CACHE_CAPACITY)] * 2
    assert int(grown) < 120, f"RSS grew {grown} MiB over 640 new shapes"


def test_a_cache_size_the_environment_sets_wins():
    _, *caps = _probe('os.environ["LRU_CACHE_CAPACITY"] = "8"')
    assert caps == ["8", str(cpu_linear.ONEDNN_CACHE_CAPACITY)]
