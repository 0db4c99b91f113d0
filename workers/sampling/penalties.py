"""Device registers for the penalties: which tokens a request has seen, how often.

One register row per request that uses a penalty (rows are assigned on the host at
launch, ``build.RegisterRows``): ``seen[row]`` marks the prompt's tokens, ``counts[row]``
counts the output tokens. They live on the device and are updated on the forward thread
right after each sample (and after a verify's acceptance), in launch order -- so the
next batch, launched before this one's result was processed, still reads counts that
include the token this one sampled (the overlap lag), exactly as with no lag. A verify
row i adds the drafts d_1..d_i on top (``PenaltyInputs.draft_*``).
"""

from __future__ import annotations

import torch

from workers.sampling.inputs import PenaltyInputs


class PenaltyState:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seen: torch.Tensor | None = None  # bool [C, V]
        self.counts: torch.Tensor | None = None  # int32 [C, V]

    def ensure(self, capacity: int, vocab: int) -> None:
        """Grow to ``capacity`` rows (keeping what is there); rows are lazily allocated."""
        have = 0 if self.seen is None else self.seen.shape[0]
        if capacity <= have:
            return
        size = max(capacity, 2 * have, 8)
        seen = torch.zeros(size, vocab, dtype=torch.bool, device=self.device)
        counts = torch.zeros(size, vocab, dtype=torch.int32, device=self.device)
        if self.seen is not None and self.counts is not None:
            seen[:have] = self.seen
            counts[:have] = self.counts
        self.seen, self.counts = seen, counts

    def prepare(self, p: PenaltyInputs, vocab: int) -> None:
        """Grow, then rebuild the registers of requests sampled for the first time since
        their admission (from the host's prompt and output tokens)."""
        self.ensure(p.capacity, vocab)
        assert self.seen is not None and self.counts is not None
        if not p.init_registers:
            return
        regs = torch.tensor(p.init_registers, dtype=torch.int64, device=self.device)
        self.seen[regs] = False
        self.counts[regs] = 0
        if p.init_prompt is not None:
            self.seen[p.init_prompt_reg, p.init_prompt] = True
        if p.init_output is not None:
            ones = torch.ones_like(p.init_output, dtype=torch.int32)
            self.counts.index_put_((p.init_output_reg, p.init_output), ones, accumulate=True)

    def rows(self, p: PenaltyInputs, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(seen, counts) as of each penalised logits row: [P, V] each, counts as float."""
        assert self.seen is not None and self.counts is not None
        seen = self.seen[p.registers]
        counts = self.counts[p.registers].to(torch.float32)
        if p.draft_rows is not None:
            drafts = input_ids[p.draft_inputs]
            counts.index_put_((p.draft_rows, drafts), torch.ones_like(drafts, dtype=torch.float32), accumulate=True)
        return seen, counts

    def add(self, registers: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count generated tokens: ``tokens[i]`` for register row ``registers[i]``."""
        assert self.counts is not None
        self.counts.index_put_((registers, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)
