"""``RecurrentBatch``: the batch metadata every op over a slot pool takes, built once per step.

A recurrent op (``gdn``, ``kda``, ``ssd``, ``lightning``, ``selective_scan``, ``conv1d``) is
one public function ``op(inputs..., states, seqs, options...)``; its backend reads
``seqs.path`` and runs the decode, verify or varlen form, which give the same results on the
batches they accept (``tests/kernels/test_decode_fast_path.py``, ``test_verify_fast_path.py``).
The model runner's ``ForwardBatch.recurrent`` is the step's one instance, shared by every layer:
the GPU paths memoise their launch plans on these tensors' identity (``kernels.memo``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.memo import TensorMemo


class Path(enum.Enum):
    """Which form of an op a batch may take (each equals the varlen form on its batches)."""

    DECODE = "decode"  # one token per sequence, every initial state, no snapshot
    VERIFY = "verify"  # uniform_len tokens per sequence, every initial state, a snapshot at each
    VARLEN = "varlen"  # anything


LaunchArgs = tuple[Tensor, Tensor, Tensor, "Tensor | None", int]


@dataclass(frozen=True)
class RecurrentBatch:
    """B sequences, T tokens; sequence b owns rows ``cu_seqlens[b]:cu_seqlens[b + 1]``.

    ``uniform_len > 0`` is a host promise, never checked against the tensors: every sequence
    has exactly that many tokens and an initial state, and ``state_dst_slots`` is None or
    non-zero at every token. 0 is always safe (the varlen form).
    """

    cu_seqlens: Tensor  # int32 [B + 1]
    slot_ids: Tensor  # int32 [B]: each sequence's live slot
    has_initial_state: Tensor  # bool [B]: read the live slot (else zeros)
    state_dst_slots: Tensor | None = None  # int32 [T]: != 0, also write the state after token t there
    uniform_len: int = 0

    @property
    def path(self) -> Path:
        if self.uniform_len == 1 and self.state_dst_slots is None:
            return Path.DECODE
        if self.uniform_len > 0 and self.state_dst_slots is not None:
            return Path.VERIFY
        return Path.VARLEN

    @property
    def initial_flags(self) -> Tensor | None:
        """``has_initial_state``, or None where ``uniform_len`` promises every sequence has one
        (what the C++ loops take: None reads no flags)."""
        return None if self.uniform_len else self.has_initial_state

    def launch_args(self) -> LaunchArgs:
        """The fields in order, as the Triton launchers and their opaque ops take them."""
        return (self.cu_seqlens, self.slot_ids, self.has_initial_state, self.state_dst_slots, self.uniform_len)

    @classmethod
    def decode(cls, slot_ids: Tensor) -> RecurrentBatch:
        """One token per sequence on the live slots ``slot_ids``, every initial state present.

        Memoised on ``slot_ids``: calls with one step's tensor share the metadata tensors
        (and so the launch plans memoised on them).
        """
        return _decodes.get((slot_ids,), None, lambda: _unit_layout(slot_ids))


def _unit_layout(slot_ids: Tensor) -> RecurrentBatch:
    num_seqs, device = slot_ids.shape[0], slot_ids.device
    return RecurrentBatch(
        torch.arange(num_seqs + 1, dtype=torch.int32, device=device),
        slot_ids,
        torch.ones(num_seqs, dtype=torch.bool, device=device),
        None,
        1,
    )


_decodes: TensorMemo[RecurrentBatch] = TensorMemo()
