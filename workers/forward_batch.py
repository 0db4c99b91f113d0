"""The one contract between the engine and a model: what a forward step is given.

A forward step runs one flat, variable-length batch: B sequences, T new tokens in all.
Sequence b owns tokens ``cu_seqlens[b]:cu_seqlens[b+1]`` of every ``[T, ...]`` tensor.
A sequence may be a prefill chunk (many tokens, maybe continuing from an earlier chunk)
or a decode (one token); both kinds mix freely in one batch.

Shapes use one vocabulary: B sequences, T new tokens, S pool slots / KV locations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kernels.recurrent_batch import RecurrentBatch


def is_decode_only(
    num_new_tokens: Sequence[int], has_initial_state: Sequence[bool], state_dst_slots: Sequence[int] | None
) -> bool:
    """The ``ForwardBatch.decode_only`` rule, on the host lists a builder holds."""
    return (
        len(num_new_tokens) > 0
        and all(n == 1 for n in num_new_tokens)
        and all(has_initial_state)
        and (state_dst_slots is None or not any(state_dst_slots))
    )


def uniform_snapshot_len(
    num_new_tokens: Sequence[int], has_initial_state: Sequence[bool], state_dst_slots: Sequence[int] | None
) -> int:
    """The ``ForwardBatch.verify_len`` rule, on the host lists a builder holds."""
    if (
        not num_new_tokens
        or len(set(num_new_tokens)) != 1
        or not all(has_initial_state)
        or state_dst_slots is None
        or not all(state_dst_slots)
    ):
        return 0
    return num_new_tokens[0]


@dataclass(frozen=True)
class ForwardBatch:
    """Device tensors for one forward step (built once by the model runner).

    Invariants:
    - ``cu_seqlens[0] == 0``, ``cu_seqlens[-1] == T``, non-decreasing, int32.
    - ``seq_lens[b]`` is the context length after this step (cached prefix + new
      tokens); ``positions`` of sequence b run ``seq_lens[b] - q_len_b .. seq_lens[b]-1``.
    - ``out_loc[t]`` is the flat KV location (``page * page_size + offset``) where token t's
      K/V is written; ``page_table[b, i]`` is the page holding context tokens
      ``i * page_size .. (i+1) * page_size - 1`` of sequence b (unused entries are 0).
    - ``mamba_slot_ids[b]`` is sequence b's live slot in the Mamba pool; the recurrent
      layers read the initial state from it when ``has_initial_state[b]`` (zeros
      otherwise) and write the state after the last new token back into it.
    - ``logits_indices`` are the rows of the flat batch whose logits are needed
      (the last token of every sequence that samples this step).
    - ``state_dst_slots[t]``, when given and non-zero, is a Mamba slot that receives the
      recurrent and conv state after token t (a prefix-cache checkpoint or a per-draft
      state); 0 means no snapshot. The live slot still receives the final state.
    - ``decode_only`` (host flag, set by the builder from host data: reading it never syncs)
      is True only if every sequence has exactly one new token and an initial state and no
      token has a snapshot slot. The recurrent ops then take their one-step form instead of
      the varlen one (same results); False is always safe.
    - ``verify_len`` (host, likewise) is T > 0 only if every sequence has exactly T new
      tokens, an initial state, and a snapshot slot at every token (a speculative verify):
      the recurrent ops then run T batched steps without a varlen plan (same results);
      0 is always safe.
    - ``recurrent`` (derived, built once with the batch) is what every op over a slot pool
      takes: the sequence bounds, live slots, initial-state flags, snapshot slots (none on a
      decode-only batch) and the uniform length (1 if ``decode_only``, else ``verify_len``).
    """

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    cu_seqlens: torch.Tensor  # int32 [B + 1]
    seq_lens: torch.Tensor  # int32 [B]
    out_loc: torch.Tensor  # int64 [T]
    page_table: torch.Tensor  # int32 [B, max_pages]
    mamba_slot_ids: torch.Tensor  # int32 [B]
    has_initial_state: torch.Tensor  # bool  [B]
    logits_indices: torch.Tensor  # int64 [N]
    page_size: int
    state_dst_slots: torch.Tensor | None = None  # int32 [T]
    decode_only: bool = False
    verify_len: int = 0
    recurrent: RecurrentBatch = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "recurrent",
            RecurrentBatch(
                self.cu_seqlens,
                self.mamba_slot_ids,
                self.has_initial_state,
                None if self.decode_only else self.state_dst_slots,
                1 if self.decode_only else self.verify_len,
            ),
        )

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
