"""Manifold-constrained hyper-connections (mHC) of GLM-5.3-Flash: N residual streams per token.

The residual is N streams [T, N, D] (the embedding copied N times; the model's output is
their mean before the final norm). Each block (mixer, feed-forward) reads one collapsed
input and writes back into every stream, with three per-token weights projected from the
streams themselves (``HyperConnection``, checkpoint ``attn_hc`` / ``ffn_hc``):

- ``fn`` [(2 + N) N, N D] projects the flattened, RMS-normed (no weight, ``rms_norm_eps``)
  streams, in fp32, to ``[pre (N) | post (N) | comb (N N)]``; ``base`` [(2 + N) N] and
  ``scale`` [3] (fp32) are the bias and the per-part scale;
- ``pre = sigmoid(pre * s0 + b) + hc_eps`` collapses: block input ``sum_n pre_n x_n``;
- ``post = 2 sigmoid(post * s1 + b)`` expands the block output y into the streams;
- ``comb = softmax_row(comb * s2 + b) + hc_eps``, made doubly stochastic by Sinkhorn
  (a column normalisation, then ``hc_sinkhorn_iters - 1`` row-then-column rounds, each sum
  + ``hc_eps``), mixes the streams: ``x'_m = post_m y + sum_n comb[n, m] x_n``.

Everything is per token: no state between steps, nothing to shard under TP (replicated).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.models.layers import param


class HyperConnection(nn.Module):
    def __init__(
        self,
        num_streams: int,
        hidden_size: int,
        norm_eps: float,
        hc_eps: float,
        sinkhorn_iters: int,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        n = num_streams
        self.num_streams, self.norm_eps, self.hc_eps, self.sinkhorn_iters = n, norm_eps, hc_eps, sinkhorn_iters
        self.fn = param((2 + n) * n, n * hidden_size, dtype=dtype)
        self.base = param((2 + n) * n, dtype=torch.float32)
        self.scale = param(3, dtype=torch.float32)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, N, D] -> (post [T, N] fp32, comb [T, N, N] fp32, block input [T, D])."""
        n = self.num_streams
        flat = streams.reshape(streams.shape[0], -1).float()
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        mixed = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mixed.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        s_pre, s_post, s_comb = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * s_pre + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * s_post + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * s_comb + comb_b.view(n, n), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed


def expand(out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """The block output out [T, D] written back: ``post_m out + sum_n comb[n, m] streams_n`` -> [T, N, D]."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
