"""No wait of a TP rank on a peer is unbounded (workers/tp/comm.py, the liveness rules).

A rank that stalls (alive, holding its sockets, not taking part) or fails (it aborts its
group, closing its sockets as a dead process's close) at each phase -- start, idle,
mid-step, the next step or ``Stop`` -- ends its peers' waits with an error: within the
group's bound when it stalls, at once when it fails. The one wait past the bound is
ranks 1..N-1 idling for rank 0's next message. Ranks are threads over real gloo sockets
(tests/workers/tp/groups.py); a real process stopped or killed: test_local_engine.py.
"""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch

from tests.workers.tp.groups import HUNG, run_group, timed
from workers.tp.comm import TPGroup, joined_key, open_rendezvous, wait_joined
from workers.tp.messages import Stop
from workers.tp.worker import serve_steps

BOUND_S = 1.5  # the peer bound of the groups here
SLACK_S = 10.0  # scheduling delay allowed on a loaded machine
LONG_S = 60.0  # a bound that "at once" stays far below
JOIN_S = BOUND_S + 2 * SLACK_S
TIMED_OUT = r"(?i)timed out"
CLOSED = r"(?i)connection|closed|peer"

OPS = {
    "broadcast": lambda g: g.broadcast_object("step 1" if g.rank == 0 else None),
    "all_reduce": lambda g: g.all_reduce(torch.ones(4)),
    "check_same": lambda g: g.check_same(7, "the decisions of step 1"),
}


def test_a_rank_that_never_joins_fails_rank_0_within_the_bound():
    store, rendezvous = open_rendezvous("127.0.0.1", 3, BOUND_S)
    store.set(joined_key(1), "1")  # rank 1 joined; rank 2 never does
    out, seconds = timed(lambda: wait_joined(store, rendezvous), JOIN_S)
    assert isinstance(out, TimeoutError) and "ranks [2] did not join within 1.5s" in str(out), out
    assert BOUND_S <= seconds < BOUND_S + SLACK_S

    def rank_2_died() -> None:  # what a launcher's health check raises
        raise RuntimeError("tensor-parallel rank 2 exited with code -9")

    out, seconds = timed(lambda: wait_joined(store, rendezvous, rank_2_died), JOIN_S)
    assert isinstance(out, RuntimeError) and "rank 2 exited" in str(out) and seconds < SLACK_S


def test_a_rank_that_joins_but_never_connects_fails_rank_0_within_the_bound():
    store, rendezvous = open_rendezvous("127.0.0.1", 2, BOUND_S)
    store.set(joined_key(1), "1")  # rank 1 joined, then stalled
    wait_joined(store, rendezvous)
    out, seconds = timed(lambda: TPGroup(rendezvous, 0, torch.device("cpu"), store), JOIN_S)
    assert isinstance(out, RuntimeError), out
    assert "rank 0 of 2 could not connect to its peers" in str(out) and "within 1.5s" in str(out)
    assert seconds < BOUND_S + SLACK_S


@pytest.mark.parametrize("op", sorted(OPS))
def test_rank_0_waits_at_most_the_bound_for_a_stalled_rank(op):
    """Mid-step (the all-reduces, the digest check) and between steps (the next step's
    broadcast, ``Stop``): a gloo send waits for the receiver, so a stalled rank 1 held
    rank 0 for the control group's 30 days."""
    release = threading.Event()

    def fn(group: TPGroup):
        if group.rank:
            release.wait(LONG_S)  # stalled while rank 0 waits on it
            return timed(lambda: OPS[op](group), JOIN_S)
        out = timed(lambda: OPS[op](group), JOIN_S)
        group.abort(f"the {op} failed")  # as rank 0's runner does on a failure
        release.set()
        return out

    outcomes = run_group(2, fn, BOUND_S, join_s=2 * JOIN_S)
    release.set()
    assert HUNG not in outcomes, outcomes
    (out0, seconds0), (out1, seconds1) = outcomes
    assert isinstance(out0, RuntimeError) and re.search(TIMED_OUT, str(out0)), out0
    assert BOUND_S * 0.5 <= seconds0 < BOUND_S + SLACK_S
    # Rank 1 comes back to a closed group: it fails at once, not at its bound.
    assert isinstance(out1, RuntimeError) and seconds1 < BOUND_S, (out1, seconds1)


def test_rank_0s_abort_frees_the_ranks_that_took_part():
    """Three ranks: rank 1 has failed (its sockets closed), so rank 0's broadcast fails at
    once -- but gloo closes only that pair, and rank 2 waits for the broadcast (its bound is
    long) until rank 0's abort closes the rest, even while the failed op's traceback lives."""
    rank_1_gone, rank_2_done = threading.Event(), threading.Event()
    connected = threading.Barrier(3)  # every rank's mesh is up before rank 1 fails: an
    # earlier abort can fail a peer's connect instead

    def fn(group: TPGroup):
        connected.wait(LONG_S)
        if group.rank == 1:
            group.abort("rank 1 failed")
            rank_1_gone.set()
            return None
        if group.rank == 2:
            out = timed(lambda: group.broadcast_object(), JOIN_S)
            rank_2_done.set()
            return out
        rank_1_gone.wait(LONG_S)
        time.sleep(0.2)  # rank 0 has seen rank 1's sockets close
        out = timed(lambda: group.broadcast_object("step 1"), JOIN_S)
        group.abort("the broadcast failed")
        rank_2_done.wait(JOIN_S)
        return out

    outcomes = run_group(3, fn, LONG_S, join_s=2 * JOIN_S)
    assert HUNG not in outcomes, outcomes
    (out0, seconds0), _, (out2, seconds2) = outcomes
    assert isinstance(out0, RuntimeError) and re.search(CLOSED, str(out0)) and seconds0 < SLACK_S, out0
    assert isinstance(out2, RuntimeError) and re.search(CLOSED, str(out2)) and seconds2 < SLACK_S, out2


def test_an_idle_rank_waits_past_the_bound_for_rank_0s_next_message():
    """Ranks 1..N-1 between steps (``serve_steps``): the engine may idle for days. Any
    other receive keeps the bound."""

    def fn(group: TPGroup):
        if group.rank == 0:
            time.sleep(2 * BOUND_S)  # the engine idles
            group.broadcast_object("step 1")
            group.broadcast_object(Stop())
            time.sleep(2 * BOUND_S)  # sends nothing more
            group.abort("done")
            return None
        seen: list[str] = []
        served = serve_steps(group, seen.append)
        out, seconds = timed(lambda: group.broadcast_object(), JOIN_S)  # not idle
        return served, seen, out, seconds

    outcomes = run_group(2, fn, BOUND_S, join_s=4 * BOUND_S + 2 * JOIN_S)
    assert HUNG not in outcomes, outcomes
    assert outcomes[0] is None
    served, seen, out, seconds = outcomes[1]
    assert (served, seen) == (1, ["step 1"])
    assert isinstance(out, RuntimeError) and re.search(TIMED_OUT, str(out)), out
    assert BOUND_S * 0.5 <= seconds < BOUND_S + SLACK_S


def test_a_rank_that_fails_mid_step_fails_rank_0_at_once():
    """Rank 1's step raises: ``serve_steps`` aborts, so rank 0 (in the step's all-reduce)
    fails now rather than at its bound; a closed group then refuses every op, naming why."""

    def fn(group: TPGroup):
        if group.rank:

            def step(msg: object) -> None:
                raise ValueError(f"rank 1 cannot run {msg}")

            out, _ = timed(lambda: serve_steps(group, step), JOIN_S)
            return type(out).__name__, group.closed_reason
        group.broadcast_object("step 1")
        out, seconds = timed(lambda: group.all_reduce(torch.ones(4)), JOIN_S)
        group.abort("step 1 failed on rank 0")
        later, later_seconds = timed(lambda: group.broadcast_object("step 2"), JOIN_S)
        return out, seconds, later, later_seconds

    outcomes = run_group(2, fn, LONG_S, join_s=2 * JOIN_S)
    assert HUNG not in outcomes, outcomes
    (out, seconds, later, later_seconds), rank1 = outcomes
    assert isinstance(out, RuntimeError) and re.search(CLOSED, str(out)) and seconds < SLACK_S, (out, seconds)
    assert isinstance(later, RuntimeError) and later_seconds < 1.0
    assert "rank 0 is closed: step 1 failed on rank 0" in str(later)
    assert rank1 == ("ValueError", "rank 1 failed after 0 steps: ValueError('rank 1 cannot run step 1')")


@pytest.mark.parametrize("phase", ["start", "idle"])
def test_rank_0_failing_ends_an_idle_rank_at_once(phase):
    """Rank 0 fails while building (rank 1 waits for the layout) or between steps: its
    abort closes the sockets, so rank 1's wait (idle: no bound of its own) ends now --
    while rank 0 lives on and holds its group, as the engine does."""
    rank_1_done = threading.Event()

    def fn(group: TPGroup):
        if group.rank == 0:
            if phase == "idle":
                group.broadcast_object("step 1")
            time.sleep(0.5)  # rank 1 is waiting by now
            group.abort(f"rank 0 failed ({phase})")
            rank_1_done.wait(JOIN_S)
            return group.closed
        wait = (
            (lambda: group.broadcast_object(idle=True))
            if phase == "start"
            else (lambda: serve_steps(group, lambda msg: None))
        )
        out = timed(wait, JOIN_S)
        rank_1_done.set()
        return out

    outcomes = run_group(2, fn, LONG_S, join_s=2 * JOIN_S)
    rank_1_done.set()
    assert HUNG not in outcomes, outcomes
    out, seconds = outcomes[1]
    assert isinstance(out, RuntimeError) and seconds < SLACK_S, (out, seconds)
    assert re.search(CLOSED, str(out)), out
