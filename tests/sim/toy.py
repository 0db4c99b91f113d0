"""A toy recurrent model that runs the engine's real step plans at the level of slots.

State. A Mamba slot holds ``ToyState(digest, depth)``: the hash chain of the tokens folded
into it and how many there were, so any slot's content names its true prefix and depth
(the toy model of SGLang's aliasing repro). The "model output" after a token is a deterministic function
of the digest, so a wrong state yields wrong tokens and differs from a flushed control.

``ToyRunner`` replaces ``engine.runner`` (used only through ``launch(plan) ->
Future[StepResult]``) and mirrors ``ModelRunner`` slot for slot:

- ``launch`` runs ``prepare_step`` on the calling thread and the step on a single-worker
  executor under overlap (at once without), so batches execute in launch order while the
  engine processes the previous batch: the real one-step lag.
- execute: fill placeholder rows from the ``last_token`` register (token the batch before is
  sampling) and the draft register; copy-on-write copies; per sequence, start from the live
  slot (or the empty state when ``has_initial_state`` is False), fold each row's token,
  snapshot into ``state_dst_slots``; the final state goes to the live slot. A start state
  whose depth or digest is not the request's true prefix is recorded as a corruption (the
  step still runs on it, as a GPU would).
- sampling is greedy on the toy output; a verify accepts drafts greedily and then commits
  exactly like ``ModelRunner._commit``: ``scratch[a] -> live``, crossing row -> track slot.
- drafting (MTP's place): after each sampling sequence, the true continuation from the
  committed live state is written into the draft register, correct for the first ``a``
  drafts and wrong at draft ``a + 1``, with ``a`` from a script. Greedy acceptance then
  accepts exactly ``a`` (when the state is sound), whatever the engine does.

Only frozen inputs are read on the forward thread (the plan, the prepared tensors, request
ids); request fields the scheduler thread mutates are never read there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import torch

from workers.cache.checkpoints import StepPlan
from workers.model_runner import StepResult
from workers.step_inputs import PreparedStep, prepare_step, resolve_chained

MASK = (1 << 64) - 1
ROOT_DIGEST = 0x243F6A8885A308D3


class ToyState(NamedTuple):
    digest: int
    depth: int


EMPTY = ToyState(ROOT_DIGEST, 0)


def fold(state: ToyState, token: int) -> ToyState:
    """The state after one more token (a splitmix-style 64-bit chain link)."""
    x = (state.digest ^ ((token + 0x9E3779B97F4A7C15) & MASK)) * 0xBF58476D1CE4E5B9 & MASK
    x ^= x >> 31
    x = x * 0x94D049BB133111EB & MASK
    x ^= x >> 29
    return ToyState(x, state.depth + 1)


def chain(tokens: Sequence[int], state: ToyState = EMPTY) -> ToyState:
    for t in tokens:
        state = fold(state, t)
    return state


class ToyVocab:
    """Which tokens the toy emits: [low, high), clear of the tiny vocabulary's specials."""

    def __init__(self, vocab_size: int, low: int = 3, reserved_top: int = 8) -> None:
        self.low, self.high = low, vocab_size - reserved_top
        assert self.high - self.low > 2

    def emit(self, state: ToyState) -> int:
        """The greedy token after ``state`` (a function of the digest only)."""
        return self.low + (state.digest >> 7) % (self.high - self.low)

    def wrong(self, token: int) -> int:
        """A valid token that is not ``token``."""
        return self.low + (token - self.low + 1) % (self.high - self.low)

    def greedy(self, tokens: Sequence[int], n: int) -> list[int]:
        """The analytic greedy continuation: what any correct engine must output."""
        state, out = chain(tokens), []
        for _ in range(n):
            out.append(self.emit(state))
            state = fold(state, out[-1])
        return out


# script(request_id, position of the next verify's row 0, first verify?, k) -> drafts to accept
AcceptScript = Callable[[str, int, bool, int], int]


def default_script(request_id: str, position: int, first: bool, k: int) -> int:
    """First verify of a request: all drafts right; later ones: a mix of 0 .. k."""
    if first:
        return k
    return chain([position], chain(request_id.encode())).digest % (k + 1)


@dataclass(frozen=True)
class Corruption:
    """A step read a live state that is not the request's true prefix."""

    batch_id: int
    request_id: str
    start: int
    got_depth: int
    digest_ok: bool


class _SeqMeta(NamedTuple):
    request_id: str
    expected: ToyState | None  # the true state at ``start`` when the step reads the slot


class ToyRunner:
    def __init__(
        self,
        num_slots: int,
        page_size: int,
        scratch_base: int,
        num_draft_tokens: int,
        vocab: ToyVocab,
        overlap: bool,
        script: AcceptScript = default_script,
    ) -> None:
        self.page_size, self.scratch_base, self.k = page_size, scratch_base, num_draft_tokens
        self.vocab, self.script = vocab, script
        self.pool: list[ToyState] = [EMPTY] * num_slots
        self.last_token = [0] * num_slots
        self.accepted = [0] * num_slots  # as ModelRunner.accepted_host
        self.committed: list[list[int]] = [[] for _ in range(num_slots)]  # a verify's tokens
        self.draft_tokens = [[0] * max(num_draft_tokens, 1) for _ in range(num_slots)]
        self.corruptions: list[Corruption] = []
        self.num_steps = 0
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="toy-forward") if overlap else None
        self._prefix_cache: dict[str, tuple[int, ToyState]] = {}

    @classmethod
    def install(cls, engine, script: AcceptScript = default_script) -> ToyRunner:
        """Replace ``engine.runner`` with a toy runner shaped like the real one."""
        runner = cls(
            engine.pools.mamba.num_slots,
            engine.config.cache.page_size,
            engine.slot_ledger.num_slots,
            engine.scheduler.num_draft_tokens,
            ToyVocab(engine.vocab_size),
            overlap=engine.lag > 0,
            script=script,
        )
        engine.runner = runner
        return runner

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    def drop_request(self, req) -> None:
        """A request finished: the toy keeps no per-request sampling state."""

    def wait_started(self) -> None:
        """The toy's forward is Python throughout (it holds the GIL): nothing to wait for."""

    # -- the scheduler thread ---------------------------------------------------------------
    def launch(self, plan: StepPlan) -> Future[StepResult]:
        prepared = prepare_step(plan, self.page_size, torch.device("cpu"), self.scratch_base)
        meta = [self._meta(seq) for seq in plan.batch.seqs]
        if self._executor is not None:
            return self._executor.submit(self._execute, prepared, meta)
        done: Future[StepResult] = Future()
        done.set_result(self._execute(prepared, meta))
        return done

    def _meta(self, seq) -> _SeqMeta:
        req = seq.request
        if seq.start == 0:
            return _SeqMeta(req.request_id, None)
        return _SeqMeta(req.request_id, self._true_state(req.request_id, req.token_slice(0, seq.start)))

    def _true_state(self, request_id: str, tokens: list[int]) -> ToyState:
        """chain(tokens), extending the last one computed for the request when possible."""
        n, state = self._prefix_cache.get(request_id, (0, EMPTY))
        if n > len(tokens):
            n, state = 0, EMPTY
        state = chain(tokens[n:], state)
        self._prefix_cache[request_id] = (len(tokens), state)
        return state

    # -- the forward thread -------------------------------------------------------------------
    def _execute(self, prepared: PreparedStep, meta: list[_SeqMeta]) -> StepResult:
        self.num_steps += 1
        plan, fb, pool = prepared.plan, prepared.fb, self.pool
        ids = fb.input_ids.tolist()
        if prepared.future_rows is not None:
            for r, s in zip(prepared.future_rows.tolist(), prepared.future_slots.tolist()):
                ids[r] = self.last_token[s]
        if prepared.draft_rows is not None:
            for r, s, i in zip(
                prepared.draft_rows.tolist(), prepared.draft_slots.tolist(), prepared.draft_index.tolist()
            ):
                ids[r] = self.draft_tokens[s][i]
        meta = self._chained_meta(prepared, meta)
        prepared = resolve_chained(prepared, torch.tensor(self.accepted), self.accepted)
        fb = prepared.fb
        if plan.cow:  # gather, then scatter (like copy_slot)
            states = [pool[src] for src, _ in plan.cow]
            for (_, dst), state in zip(plan.cow, states):
                pool[dst] = state
        # Forward: fold rows, snapshot into state_dst_slots, final state into the live slot.
        cu, live = fb.cu_seqlens.tolist(), fb.mamba_slot_ids.tolist()
        init, positions = fb.has_initial_state.tolist(), fb.positions.tolist()
        dst = fb.state_dst_slots.tolist() if fb.state_dst_slots is not None else None
        out = [0] * len(ids)
        for b, seq in enumerate(plan.batch.seqs):
            state = pool[live[b]] if init[b] else EMPTY
            expected = meta[b].expected
            if init[b] and (state.depth != positions[cu[b]] or (expected is not None and state != expected)):
                digest_ok = expected is not None and state.digest == expected.digest
                self.corruptions.append(
                    Corruption(plan.batch.batch_id, meta[b].request_id, prepared.starts[b], state.depth, digest_ok)
                )
            for t in range(cu[b], cu[b + 1]):
                state = fold(state, ids[t])
                out[t] = self.vocab.emit(state)
                if dst is not None and dst[t]:
                    pool[dst[t]] = state
            pool[live[b]] = state
        if prepared.copy_src is not None:  # a decode batch's snapshots, as ModelRunner
            for src, d in zip(prepared.copy_src.tolist(), prepared.copy_dst.tolist()):
                pool[d] = pool[src]
        # Sampling (greedy) or verify + commit.
        verify = {v.seq_index: v for v in prepared.verify}
        writes = list(prepared.writes)
        tokens: list[list[int]] = []
        accepted: list[int | None] = []
        for b, seq in enumerate(plan.batch.seqs):
            if not seq.samples:
                continue
            v = verify.get(b)
            if v is None:
                tokens.append([out[cu[b + 1] - 1]])
                accepted.append(None)
                continue
            best = out[v.first_row : v.first_row + v.num_drafts + 1]
            drafts = ids[v.first_row + 1 : v.first_row + 1 + v.num_drafts]
            n = 0
            while n < len(drafts) and drafts[n] == best[n]:
                n += 1
            tokens.append(drafts[:n] + [best[n]])
            accepted.append(n)
            self.accepted[v.live_slot], self.committed[v.live_slot] = n, tokens[-1]
            src, dsts, committed = v.commit(n, prepared.starts[b])  # as ModelRunner._verify
            writes.extend(committed)
            states = [pool[s] for s in src]
            for d, state in zip(dsts, states):
                pool[d] = state
        # last_token registers and drafts (the MTP head's place).
        n = 0
        for b, seq in enumerate(plan.batch.seqs):
            if not seq.samples:
                continue
            last = tokens[n][-1]
            self.last_token[live[b]] = last
            if self.k:
                is_verify = accepted[n] is not None
                position = prepared.starts[b] + accepted[n] + 1 if is_verify else seq.end
                self._draft(live[b], last, meta[b].request_id, position, first=not is_verify)
            n += 1
        return StepResult(tokens, [[None] * len(t) for t in tokens], accepted, tuple(writes))

    def _chained_meta(self, prepared: PreparedStep, meta: list[_SeqMeta]) -> list[_SeqMeta]:
        """A chained verify's true start state: its least start's, advanced by the drafts the
        verify before accepted (its committed tokens but the last)."""
        meta = list(meta)
        for b in prepared.chained_seqs:
            slot, m = prepared.live_slots[b], meta[b]
            if m.expected is not None:
                meta[b] = m._replace(expected=chain(self.committed[slot][: self.accepted[slot]], m.expected))
        return meta

    def _draft(self, slot: int, last: int, request_id: str, position: int, first: bool) -> None:
        a = max(0, min(self.k, self.script(request_id, position, first, self.k)))
        state, drafts = self.pool[slot], []
        token = last
        for j in range(self.k):
            state = fold(state, token)
            right = self.vocab.emit(state)
            token = right if j < a else self.vocab.wrong(right)
            drafts.append(token)
        self.draft_tokens[slot] = drafts
