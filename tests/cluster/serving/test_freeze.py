"""A replica freezes what it built at start-up: a full collection never walks the engine."""

from __future__ import annotations

import gc

from cluster.serving.replica import freeze_startup_objects


def test_startup_objects_leave_the_collected_generations():
    built = [[i] for i in range(1000)]  # stands in for the engine's objects
    try:
        frozen = freeze_startup_objects()
        # <=: another thread of the test process (a forward thread winding down) may free
        # frozen objects in between
        assert frozen >= len(built) and len(built) <= gc.get_freeze_count() <= frozen
        collected = {id(o) for o in gc.get_objects()}
        assert not any(id(o) in collected for o in built)
        later = [[0]]  # made after start-up: collected as usual
        assert id(later) in {id(o) for o in gc.get_objects()}
    finally:
        gc.unfreeze()
