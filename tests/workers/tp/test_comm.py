"""The TP process group over real gloo sockets, ranks as threads of this process."""

from __future__ import annotations

import pytest
import torch

from tests.workers.tp.groups import run_group
from workers.tp.comm import TPGroup, open_rendezvous


def test_all_reduce_and_broadcast():
    def fn(group: TPGroup):
        t = torch.full((3,), float(group.rank + 1))
        group.all_reduce(t)
        obj = group.broadcast_object({"step": 7, "ids": [1, 2]} if group.rank == 0 else None)
        big = group.broadcast_bytes(bytes(range(256)) * 1000 if group.rank == 0 else None)
        return t.tolist(), obj, len(big)

    for out in run_group(2, fn):
        assert out == ([3.0, 3.0, 3.0], {"step": 7, "ids": [1, 2]}, 256_000)


def test_diverged_ranks_are_reported_on_every_rank():
    def fn(group: TPGroup):
        group.check_same(42, "agreeing")
        group.check_same(group.rank, "the decisions of step 3")

    for out in run_group(2, fn):
        assert isinstance(out, RuntimeError) and "diverged: the decisions of step 3" in str(out)


def test_a_rank_outside_the_group_is_refused():
    _, rendezvous = open_rendezvous("127.0.0.1", 2)
    with pytest.raises(ValueError, match="rank 2 is outside world size 2"):
        TPGroup(rendezvous, 2, torch.device("cpu"))
