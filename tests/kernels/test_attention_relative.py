"""The relative-bias paged attention (``kernels/attention/relative.py``, Inkling's layers):
the planned eager form and the traced uniform form against a dense per-sequence formula, with
and without Inkling2's per-token attention sinks."""

from __future__ import annotations

import pytest
import torch

from kernels.attention import relative

PAGE = 4


def _dense(q, k, v, rel, proj, scale, window, sinks=None):
    """One sequence: q [Q, H, D] at the last Q of L positions, k / v [L, Hkv, D]; sinks [Q, H]:
    one more logit per query and head, of value zero."""
    num_q, heads = q.shape[:2]
    length = k.shape[0]
    group = heads // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    q_pos = torch.arange(length - num_q, length)[:, None]
    dist = q_pos - torch.arange(length)[None, :]  # [Q, L]
    logits = rel @ proj  # [Q, H, E]
    idx = dist.clamp(0, proj.shape[1] - 1)[:, None, :].expand(num_q, heads, length)
    bias = logits.gather(-1, idx).masked_fill(((dist < 0) | (dist >= proj.shape[1]))[:, None], 0.0)
    scores = torch.einsum("qhd,lhd->qhl", q, k) * scale + bias
    mask = dist >= 0
    if window is not None:
        mask &= dist < window
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    if sinks is not None:
        return torch.einsum("qhl,lhd->qhd", torch.cat([scores, sinks[..., None]], -1).softmax(-1)[..., :-1], v)
    return torch.einsum("qhl,lhd->qhd", scores.softmax(-1), v)


def _batch(q_lens, ctx_lens, heads=4, kv_heads=2, dim=8, d_rel=3, extent=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pages_per = [(n + PAGE - 1) // PAGE for n in ctx_lens]
    perm = torch.randperm(sum(pages_per), generator=gen) + 1  # page 0 is the dummy
    table = torch.zeros(len(ctx_lens), max(pages_per), dtype=torch.int32)
    start = 0
    for b, n in enumerate(pages_per):
        table[b, :n] = perm[start : start + n]
        start += n
    pool_rows = (sum(pages_per) + 1) * PAGE
    ks = [torch.randn(n, kv_heads, dim, generator=gen) for n in ctx_lens]
    vs = [torch.randn(n, kv_heads, dim, generator=gen) for n in ctx_lens]
    k_pool, v_pool = torch.zeros(pool_rows, kv_heads, dim), torch.zeros(pool_rows, kv_heads, dim)
    out_loc = []
    for b, (nq, n) in enumerate(zip(q_lens, ctx_lens)):
        locs = [int(table[b, p // PAGE]) * PAGE + p % PAGE for p in range(n)]
        k_pool[locs[: n - nq]], v_pool[locs[: n - nq]] = ks[b][: n - nq], vs[b][: n - nq]
        out_loc += locs[n - nq :]
    q = torch.randn(sum(q_lens), heads, dim, generator=gen)
    rel = torch.randn(sum(q_lens), heads, d_rel, generator=gen)
    proj = torch.randn(d_rel, extent, generator=gen)
    new_k = torch.cat([k[n - nq :] for k, nq, n in zip(ks, q_lens, ctx_lens)])
    new_v = torch.cat([v[n - nq :] for v, nq, n in zip(vs, q_lens, ctx_lens)])
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(ctx_lens, dtype=torch.int32)
    args = (q, new_k, new_v, k_pool, v_pool, torch.tensor(out_loc), table, cu, seq_lens)
    return args, ks, vs, rel, proj


def _expected(args, ks, vs, rel, proj, scale, window, sinks=None):
    q, cu = args[0], args[7].tolist()
    outs = [
        _dense(
            q[cu[b] : cu[b + 1]],
            ks[b],
            vs[b],
            rel[cu[b] : cu[b + 1]],
            proj,
            scale,
            window,
            None if sinks is None else sinks[cu[b] : cu[b + 1]],
        )
        for b in range(len(ks))
    ]
    return torch.cat(outs)


@pytest.mark.parametrize("window", [None, 5])
def test_planned_form_equals_dense(window):
    args, ks, vs, rel, proj = _batch([1, 7, 1, 12], [9, 7, 3, 20])
    got = relative.paged_attention_relative(*args, PAGE, 0.3, rel, proj, window)
    torch.testing.assert_close(got, _expected(args, ks, vs, rel, proj, 0.3, window), atol=1e-5, rtol=0)


@pytest.mark.parametrize("window", [None, 5])
def test_uniform_form_equals_dense(window):
    """The traced form (every page read, keys past the query masked) on uniform rows."""
    args, ks, vs, rel, proj = _batch([2, 2, 2], [11, 2, 17], seed=1)
    q, k, v, k_pool, v_pool, out_loc, table, cu, seq_lens = args
    relative.write_kv(k, v, k_pool, v_pool, out_loc)
    got = relative._attend_uniform(q, k_pool, v_pool, table, seq_lens, PAGE, 0.3, rel, proj, window)
    torch.testing.assert_close(got, _expected(args, ks, vs, rel, proj, 0.3, window), atol=1e-5, rtol=0)


@pytest.mark.parametrize("window", [None, 5])
def test_sinks_in_both_forms(window):
    """Sinks (3 above the scores' scale, so they take a visible share) in the planned and
    the uniform forms; without them the output differs (the test can fail)."""
    args, ks, vs, rel, proj = _batch([1, 7, 1, 12], [9, 7, 3, 20], seed=2)
    sinks = 3.0 * torch.randn(args[0].shape[:2], generator=torch.Generator().manual_seed(3))
    want = _expected(args, ks, vs, rel, proj, 0.3, window, sinks)
    got = relative.paged_attention_relative(*args, PAGE, 0.3, rel, proj, window, sinks)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (got - _expected(args, ks, vs, rel, proj, 0.3, window)).abs().max() > 1e-2
    args, ks, vs, rel, proj = _batch([2, 2, 2], [11, 2, 17], seed=4)
    q, k, v, k_pool, v_pool, out_loc, table, cu, seq_lens = args
    sinks = 3.0 * torch.randn(q.shape[:2], generator=torch.Generator().manual_seed(5))
    relative.write_kv(k, v, k_pool, v_pool, out_loc)
    got = relative._attend_uniform(q, k_pool, v_pool, table, seq_lens, PAGE, 0.3, rel, proj, window, sinks)
    torch.testing.assert_close(got, _expected(args, ks, vs, rel, proj, 0.3, window, sinks), atol=1e-5, rtol=0)
