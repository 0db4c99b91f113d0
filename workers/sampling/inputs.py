"""What one step's sampling needs, built on the host at launch (``workers.sampling.build``).

Everything here is CPU tensors and tuples, frozen at launch: the forward thread moves
the tensors to the device (``on``), and a TP step message carries the object to the
other ranks unchanged. Row vocabulary: R logits rows (the sampling rows of the batch in
order: one per sampling sequence, ``1 + k`` for a verify of k drafts), T flat input rows.

What the host cannot know at launch -- the token the batch before is sampling, the MTP
drafts -- is never read here: it is in the input rows (placeholders filled on the
forward thread) and in device registers updated after every sample (penalty counts),
or in grammar matchers advanced on the forward thread. That is how the overlap lag and
speculation are handled: the processors see, at each row, the history as of that row.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from workers.sampling.seeded import SeededSeq
from workers.sampling.structured import StructuredOutput


def _on(obj, device: torch.device):
    """A copy of a frozen dataclass with every (nested) tensor field moved to ``device``."""
    changes = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, torch.Tensor) and value.device != device:
            changes[f.name] = value.to(device, non_blocking=True)
        elif hasattr(value, "__dataclass_fields__"):
            moved = _on(value, device)
            if moved is not value:
                changes[f.name] = moved
    return replace(obj, **changes) if changes else obj


@dataclass(frozen=True)
class RowFilters:
    """Per logits row: temperature and the truncations (rows that do not sample: 1 / off)."""

    greedy: torch.Tensor  # bool [R]
    temperature: torch.Tensor  # float32 [R] (1.0 on greedy rows)
    top_k: torch.Tensor | None  # int64 [R], 0 = off; None: no row uses top-k
    top_p: torch.Tensor | None  # float32 [R], 1.0 = off
    min_p: torch.Tensor | None  # float32 [R], 0.0 = off


@dataclass(frozen=True)
class RowTokens:
    """(row, token) pairs, with a value each where one is needed (a bias)."""

    rows: torch.Tensor  # int64 [N] logits rows
    tokens: torch.Tensor  # int64 [N]
    values: torch.Tensor | None = None  # float32 [N]


@dataclass(frozen=True)
class PenaltyInputs:
    """Rows with repetition / frequency / presence penalties and their register rows.

    ``draft_rows[j]`` (an index into ``rows``) also counts the token of flat input row
    ``draft_inputs[j]``: a verify row i sees the drafts d_1..d_i as already generated.
    ``init_*``: registers (re)built this step from host data, before anything reads them
    (a request's first sample after admission or preemption): the prompt token ids and
    the output token ids so far, flat, with the register row of each.
    """

    rows: torch.Tensor  # int64 [P] logits rows
    registers: torch.Tensor  # int64 [P] register row of each
    repetition: torch.Tensor  # float32 [P]
    frequency: torch.Tensor  # float32 [P]
    presence: torch.Tensor  # float32 [P]
    draft_rows: torch.Tensor | None  # int64 [D] into rows
    draft_inputs: torch.Tensor | None  # int64 [D] flat input rows
    init_registers: tuple[int, ...]
    init_prompt: torch.Tensor | None  # int64 [Np]
    init_prompt_reg: torch.Tensor | None
    init_output: torch.Tensor | None  # int64 [No]
    init_output_reg: torch.Tensor | None
    seq_registers: tuple[int, ...]  # per sampling sequence: its register row, -1 = none
    capacity: int  # register rows the device state must have


@dataclass(frozen=True)
class BadWordInputs:
    """One (row, word) pair per entry whose prefix could match: ban ``banned[p]`` at
    ``rows[p]`` when the W tokens ending at the row's input equal ``prefix[p]`` (-1 =
    any). ``gather[p, c]`` indexes ``cat(input_ids, history)``: history holds the
    host-known tokens just before each sequence's first input row."""

    rows: torch.Tensor  # int64 [P]
    banned: torch.Tensor  # int64 [P]
    prefix: torch.Tensor  # int64 [P, W]
    gather: torch.Tensor  # int64 [P, W]
    history: torch.Tensor  # int64 [H]


@dataclass(frozen=True)
class GrammarRows:
    """A sampling sequence under a grammar: its rows, and for a verify the input rows of
    its drafts (row i's mask is the grammar state after drafts 1..i)."""

    seq: int  # index among the sampling sequences
    handle: int  # the request's engine handle
    constraint: StructuredOutput
    first_row: int
    draft_inputs: tuple[int, ...]
    replay: tuple[int, ...] = ()  # outputs given at add: a new matcher accepts them first


@dataclass(frozen=True)
class PromptInputs:
    """Prompt logprobs: the flat hidden rows whose logits score the next prompt token."""

    hidden_rows: torch.Tensor  # int64 [Q]
    targets: torch.Tensor  # int64 [Q] the prompt token each row scores
    seqs: tuple[tuple[int, int, int, int], ...]  # (batch index, first position scored, count, top-k)


@dataclass(frozen=True)
class SamplingInputs:
    widths: tuple[int, ...]  # logits rows per sampling sequence
    filters: RowFilters | None  # None when every row is greedy
    logprob_seqs: tuple[int, ...]  # sampling sequences that need chosen-token logprobs
    max_top_logprobs: int  # top alternatives over those (0 = only the chosen)
    bias: RowTokens | None = None  # logit_bias: values added
    blocked: RowTokens | None = None  # min_tokens: EOS and stop tokens set to -inf
    penalties: PenaltyInputs | None = None
    bad_words: BadWordInputs | None = None
    grammar: tuple[GrammarRows, ...] = ()
    grammar_drops: tuple[int, ...] = ()  # handles of requests whose matchers go before this step
    prompt: PromptInputs | None = None
    seeded: tuple[SeededSeq, ...] = ()  # sequences whose draws are keyed by position

    @property
    def num_rows(self) -> int:
        return sum(self.widths)

    def on(self, device: torch.device) -> SamplingInputs:
        if (
            self.filters is None
            and self.bias is None
            and self.blocked is None
            and self.penalties is None
            and self.bad_words is None
            and self.prompt is None
        ):
            return self  # no tensor anywhere (a plain greedy step)
        return _on(self, device)
