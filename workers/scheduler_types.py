"""What the scheduler decides for one step (frozen; read by the runner and the caches)."""
from __future__ import annotations

from dataclasses import dataclass

from workers.request import Request


class SeqSpan:
    """What a step's share of a request spans, from ``start``, ``num_new_tokens`` and
    ``num_draft_tokens`` (mixed into ``ScheduledSeq`` and its TP wire copy ``SeqView``)."""

    start: int
    num_new_tokens: int
    num_draft_tokens: int

    @property
    def is_verify(self) -> bool:
        return self.num_draft_tokens > 0

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens


@dataclass(frozen=True)
class ScheduledSeq(SeqSpan):
    """One request's share of a step: compute tokens ``[start, start + num_new_tokens)``."""

    request: Request
    start: int
    num_new_tokens: int
    samples: bool          # the chunk reaches the end of the known tokens: sample after it
    num_draft_tokens: int = 0   # a speculative verify: 1 real token + this many drafts


@dataclass(frozen=True)
class StateWrite:
    """A step wrote H(``depth``) of sequence ``seq_index``'s request into Mamba slot ``slot``.

    Runners report these from the rows they actually fed the kernels (and, for a verify,
    the rows they committed), not from the plan: they are the source of every depth label.
    """

    seq_index: int
    slot: int
    depth: int


@dataclass(frozen=True)
class ScheduledBatch:
    batch_id: int
    seqs: tuple[ScheduledSeq, ...]
    preempted: tuple[Request, ...]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)
