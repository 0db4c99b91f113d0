"""Plays the engine for model tests: pools, page/slot allocation and ForwardBatch building.

Pages and slots are handed out in a shuffled (but seeded) order so page tables are not
contiguous and slot ids not sequence ids; the Mamba pool starts as NaN and the KV pool as
large random garbage, so reading a state that was never written shows up in the logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workers.device_pools import build_pools
from workers.forward_batch import ForwardBatch, is_decode_only
from workers.models.base import HybridForCausalLM


@dataclass
class SeqState:
    slot: int
    pages: list[int] = field(default_factory=list)
    num_tokens: int = 0  # context length so far


class Harness:
    def __init__(
        self, model: HybridForCausalLM, max_seqs: int = 8, max_tokens: int = 256, page_size: int = 4, seed: int = 0
    ) -> None:
        spec = model.cache_spec()
        gen = torch.Generator().manual_seed(seed)
        num_pages = 1 + max_seqs * (-(-max_tokens // page_size))
        cpu = torch.device("cpu")
        self.model = model
        self.page_size = page_size
        self.pools = build_pools(spec, num_pages, page_size, max_seqs + 1, model.dtype, cpu)
        for t in self.pools.kv.tensors():
            t.copy_(100 * torch.randn(t.shape, generator=gen))
        for t in self.pools.mamba.tensors():
            t.fill_(float("nan"))
        self.free_pages = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
        self.free_slots = (torch.randperm(max_seqs, generator=gen) + 1).tolist()
        self.seqs: dict[int, SeqState] = {}

    def _seq(self, seq_id: int) -> SeqState:
        if seq_id not in self.seqs:
            self.seqs[seq_id] = SeqState(slot=self.free_slots.pop())
        return self.seqs[seq_id]

    def _locations(self, state: SeqState, num_new: int) -> list[int]:
        locs = []
        for pos in range(state.num_tokens, state.num_tokens + num_new):
            if pos // self.page_size == len(state.pages):
                state.pages.append(self.free_pages.pop())
            locs.append(state.pages[pos // self.page_size] * self.page_size + pos % self.page_size)
        return locs

    def make_batch(self, chunks: list[tuple[int, list[int]]]) -> ForwardBatch:
        """One step: ``(seq_id, new token ids)`` per sequence; advances the sequences."""
        ids, positions, out_loc, cu, seq_lens, slots, has_init = [], [], [], [0], [], [], []
        for seq_id, tokens in chunks:
            state = self._seq(seq_id)
            start = state.num_tokens
            out_loc += self._locations(state, len(tokens))
            ids += tokens
            positions += range(start, start + len(tokens))
            cu.append(cu[-1] + len(tokens))
            seq_lens.append(start + len(tokens))
            slots.append(state.slot)
            has_init.append(start > 0)
            state.num_tokens += len(tokens)
        max_pages = max(len(self.seqs[s].pages) for s, _ in chunks)
        table = [self.seqs[s].pages + [0] * (max_pages - len(self.seqs[s].pages)) for s, _ in chunks]
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            cu_seqlens=torch.tensor(cu, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            out_loc=torch.tensor(out_loc, dtype=torch.int64),
            page_table=torch.tensor(table, dtype=torch.int32),
            mamba_slot_ids=torch.tensor(slots, dtype=torch.int32),
            has_initial_state=torch.tensor(has_init, dtype=torch.bool),
            logits_indices=torch.tensor(cu[1:], dtype=torch.int64) - 1,
            page_size=self.page_size,
            decode_only=is_decode_only([len(t) for _, t in chunks], has_init, None),
        )

    @torch.inference_mode()
    def step(self, chunks: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """Run one forward; returns each sequence's logits for all its new tokens [q_len, V]."""
        batch = self.make_batch(chunks)
        logits = self.model.compute_logits(self.model(batch, self.pools))
        cu = batch.cu_seqlens.tolist()
        return [logits[cu[b] : cu[b + 1]] for b in range(len(chunks))]

    def prefill(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """(a) All prompts prefilled together from empty state (sequence ids 0..n-1)."""
        return self.step(list(enumerate(prompts)))

    def decode(self, tokens: list[int]) -> list[torch.Tensor]:
        """(c) One new token for every sequence 0..n-1, all in one batch; -> [V] each."""
        return [x[0] for x in self.step(list(enumerate([[t] for t in tokens])))]


def random_prompts(vocab_size: int, lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # ids 0..2 are the special tokens of the tiny tokenizer
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lengths]
