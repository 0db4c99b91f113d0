"""MTP drafting on the forward thread: catch the head's KV up, then chain k drafts.

Per sequence, after the target forward (and, for a verify, acceptance), the head runs on
rows t = t0 .. t1 - 1 with (h_t, x_{t+1}) so its KV covers every computed position. For
a sequence that samples, the last row's output drafts d_1, and k - 1 chained rows (each
fed the previous draft and the head's own output) draft d_2 .. d_k. Drafts (and, for
unseeded sampled drafting, the distribution each was drawn from) go to per-slot registers
that the next verify of the request reads. A seeded draft is drawn with the noise the
target will draw its token at that position with (``workers.sampling.seeded``). Chained
rows write speculative KV at positions the next catch-up overwrites.

A head of N > 1 layers (``workers/models/mtp.py``) catches every layer up over the same
rows: layer j's row t takes layer j-1's output at t - 1. The output at t1 - 1 of layers
0..N-2 is kept per live slot (``layer_out``) with the request and position it belongs to,
so the next catch-up of the same request starts from it; without one (the first rows of a
request, a prefix-cache hit, a preemption) that input is zeros, which changes drafts only.
Chained step i runs layer ``i % N``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.compiled.draft_chain import CompiledChain
from workers.device_pools import DevicePools
from workers.forward_batch import ForwardBatch
from workers.sampling.params import SamplingParams
from workers.sampling.sampler import _filter_top_k_top_p
from workers.sampling.seeded import keyed_noise, position_seed
from workers.spec.draft_vocab import DraftVocab


@dataclass(frozen=True)
class MtpSpan:
    start: int  # position t0 of the first row
    hidden: torch.Tensor  # [n, H] target hidden h_t0 .. h_t0+n-1
    next_ids: torch.Tensor  # [n] x_{t+1} for each row
    page_ids: list[int]
    live_slot: int
    request_id: str
    params: SamplingParams | None  # None: only catch up, no drafts
    generator: torch.Generator | None


class MtpDrafter:
    def __init__(
        self,
        mtp: torch.nn.Module,
        target: torch.nn.Module,
        pools: DevicePools,
        num_drafts: int,
        page_size: int,
        max_model_len: int,
        num_slots: int,
        device: torch.device,
        vocab: DraftVocab | None = None,
    ) -> None:
        self.mtp, self.target, self.pools = mtp, target, pools
        self.vocab = vocab or DraftVocab()
        self.k, self.page_size, self.max_model_len = num_drafts, page_size, max_model_len
        self.device = device
        self.draft_tokens = torch.zeros(num_slots, num_drafts, dtype=torch.int64, device=device)
        self.draft_probs: torch.Tensor | None = None  # [slots, k, V] once sampling is used
        self.num_layers = int(getattr(mtp, "num_layers", 1))
        hidden_size = target.model.embedding.weight.shape[1]
        # layers 0..N-2: output at the last caught-up row, and (request id, position) of it
        self.layer_out = torch.zeros(
            num_slots, max(self.num_layers - 1, 0), hidden_size, dtype=target.dtype, device=device
        )
        self.layer_out_key: list[tuple[str, int] | None] = [None] * num_slots
        self.compiled_chain: CompiledChain | None = None  # set by workers.compiled.build_compiled

    def _batch(self, spans: list[MtpSpan], starts: list[int], lengths: list[int], ids: torch.Tensor) -> ForwardBatch:
        ps = self.page_size
        positions, out_loc, cu = [], [], [0]
        for span, t0, n in zip(spans, starts, lengths):
            for pos in range(t0, t0 + n):
                positions.append(pos)
                out_loc.append(span.page_ids[pos // ps] * ps + pos % ps)
            cu.append(cu[-1] + n)
        max_pages = max(len(s.page_ids) for s in spans)
        table = [s.page_ids + [0] * (max_pages - len(s.page_ids)) for s in spans]
        dev, b = self.device, len(spans)
        # MTP heads keep no recurrent state (attention KV at most): the Mamba fields are
        # never read (zeros, and decode_only stays False).
        return ForwardBatch(
            input_ids=ids,
            positions=torch.tensor(positions, device=dev),
            cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([t0 + n for t0, n in zip(starts, lengths)], dtype=torch.int32, device=dev),
            out_loc=torch.tensor(out_loc, device=dev),
            page_table=torch.tensor(table, dtype=torch.int32, device=dev),
            mamba_slot_ids=torch.zeros(b, dtype=torch.int32, device=dev),
            has_initial_state=torch.zeros(b, dtype=torch.bool, device=dev),
            logits_indices=torch.tensor(cu[1:], device=dev) - 1,
            page_size=ps,
        )

    def run(self, spans: list[MtpSpan]) -> None:
        if not spans:
            return
        lengths = [int(s.next_ids.shape[0]) for s in spans]
        fb = self._batch(spans, [s.start for s in spans], lengths, torch.cat([s.next_ids for s in spans]))
        out = first = self.mtp(fb, torch.cat([s.hidden for s in spans]), self.pools)
        if self.num_layers > 1:
            self._catch_up_layers(spans, lengths, fb, out)
        drafting = [i for i, s in enumerate(spans) if s.params is not None]
        if drafting:
            self._chain(
                [spans[i] for i in drafting],
                first[fb.logits_indices[drafting]],
                [spans[i].start + lengths[i] - 1 for i in drafting],
            )

    def _catch_up_layers(self, spans: list[MtpSpan], lengths: list[int], fb: ForwardBatch, out: torch.Tensor) -> None:
        """Layers 1..N-1 over the rows of layer 0 (see the module docstring); host lists only."""
        slots = [s.live_slot for s in spans]
        slot_ids = torch.tensor(slots, device=self.device)
        usable = [self.layer_out_key[slot] == (s.request_id, s.start - 1) for slot, s in zip(slots, spans)]
        firsts = [sum(lengths[:b]) for b in range(len(spans))]
        for j in range(1, self.num_layers):
            prev = torch.zeros_like(out)  # row t of layer j takes layer j-1's row t - 1
            for a, n, slot, ok in zip(firsts, lengths, slots, usable):
                prev[a + 1 : a + n] = out[a : a + n - 1]
                if ok:
                    prev[a] = self.layer_out[slot, j - 1]
            self.layer_out[slot_ids, j - 1] = out[fb.logits_indices]
            out = self.mtp(fb, prev, self.pools, layer=j)
        for slot, s, n in zip(slots, spans, lengths):
            self.layer_out_key[slot] = (s.request_id, s.start + n - 1)

    def _chain(self, spans: list[MtpSpan], hidden: torch.Tensor, last_pos: list[int]) -> None:
        slots = torch.tensor([s.live_slot for s in spans], device=self.device)
        chain = self.compiled_chain
        greedy = all(s.params is None or s.params.is_greedy for s in spans)
        width = max(len(s.page_ids) for s in spans)
        size = chain.pick(len(spans), greedy, width) if chain is not None else None
        if size is not None:  # the whole chain in one compiled call
            assert chain is not None
            self.draft_tokens[slots] = chain.run(hidden, last_pos, [s.page_ids for s in spans], size)
            return
        for j in range(self.k):
            tokens = self._draw(self.vocab.logits(self.target, hidden), spans, slots, j, [p + 2 + j for p in last_pos])
            self.draft_tokens[slots, j] = tokens
            pos = [p + 1 + j for p in last_pos]
            keep = [i for i, p in enumerate(pos) if p < self.max_model_len]
            if j == self.k - 1 or not keep:
                return
            sub = [spans[i] for i in keep]
            fb = self._batch(sub, [pos[i] for i in keep], [1] * len(keep), tokens[keep])
            hidden = self.mtp(fb, hidden[keep], self.pools, layer=(j + 1) % self.num_layers)
            spans, slots, last_pos = sub, slots[keep], [last_pos[i] for i in keep]

    def _draw(
        self, logits: torch.Tensor, spans: list[MtpSpan], slots: torch.Tensor, j: int, positions: list[int]
    ) -> torch.Tensor:
        """Drafts from logits over the drafter's vocabulary [B, N] (token ids, [B]) for the
        tokens at ``positions``; an unseeded sampled draft's distribution goes to
        ``draft_probs`` over the whole vocabulary (rejection sampling reads it)."""
        index = logits.argmax(dim=-1)
        for i, span in enumerate(spans):
            p = span.params
            if p is None or p.is_greedy:
                continue
            probs = torch.softmax(_filter_top_k_top_p(logits[i] / p.temperature, p.effective_top_k, p.top_p), -1)
            vocab_size = int(self.target.lm_head_weight().shape[0])
            if p.seed is not None:  # the target's own noise at that position: see workers.sampling.seeded
                assert span.generator is not None
                noise = keyed_noise(probs.new_empty(vocab_size), span.generator, position_seed(p.seed, positions[i]))
                index[i] = (probs / self.vocab.subset(noise)).argmax()
                continue
            index[i] = torch.multinomial(probs, 1, generator=span.generator)[0]
            if self.draft_probs is None:
                self.draft_probs = torch.zeros(*self.draft_tokens.shape, vocab_size, device=self.device)
            self.draft_probs[slots[i], j] = self.vocab.full(probs, vocab_size)
        return self.vocab.tokens(index)
