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
    max_shift: int

    @property
    def is_verify(self) -> bool:
        return self.num_draft_tokens > 0

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def is_chained(self) -> bool:
        """A verify launched while the request's previous verify is in flight: it starts
        ``max_shift`` or fewer positions after ``start``, as many as that one accepts."""
        return self.max_shift > 0


@dataclass(frozen=True)
class ScheduledSeq(SeqSpan):
    """One request's share of a step: compute tokens ``[start, start + num_new_tokens)``."""

    request: Request
    start: int
    num_new_tokens: int
    samples: bool  # the chunk reaches the end of the known tokens: sample after it
    num_draft_tokens: int = 0  # a speculative verify: 1 real token + this many drafts
    max_shift: int = 0  # a chained verify (``is_chained``): drafts of the verify before it


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
