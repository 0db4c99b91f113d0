"""SlotLedger: exclusive ownership (I2) and pending writers (I3)."""

from __future__ import annotations

import pytest

from workers.cache import OwnershipError, RequestOwner, SlotLedger, SlotRole, TreeOwner

LIVE = RequestOwner("a", SlotRole.LIVE)
KEEP = RequestOwner("a", SlotRole.KEEP)


def test_slot_zero_is_never_handed_out_and_exhaustion_returns_none() -> None:
    ledger = SlotLedger(5)
    slots = [ledger.alloc(RequestOwner(f"r{i}", SlotRole.LIVE)) for i in range(4)]
    assert sorted(slots) == [1, 2, 3, 4]  # type: ignore[type-var]
    assert ledger.alloc(LIVE) is None
    assert ledger.alloc_many([LIVE]) is None
    assert ledger.counts().num_free == 0 and ledger.check() == []


def test_alloc_many_is_all_or_nothing() -> None:
    ledger = SlotLedger(4)
    assert ledger.alloc_many([LIVE, KEEP, RequestOwner("a", SlotRole.PENDING), LIVE]) is None
    assert ledger.num_free == 3 and ledger.num_request_owned == 0
    assert ledger.alloc_many([LIVE, KEEP]) == [1, 2]
    assert ledger.slots_of("a") == {1: SlotRole.LIVE, 2: SlotRole.KEEP}


def test_counts_by_owner_kind_and_conservation() -> None:
    ledger = SlotLedger(8)
    live, keep = ledger.alloc(LIVE), ledger.alloc(KEEP)
    pending = ledger.alloc(RequestOwner("b", SlotRole.PENDING))
    tree = ledger.alloc(TreeOwner(7))
    assert None not in (live, keep, pending, tree)
    counts = ledger.counts()
    assert counts == (3, 1, 1, 1, 1)
    assert counts.num_request_owned == 3 and ledger.num_tree_owned == 1
    assert counts.num_free + counts.num_request_owned + counts.num_tree == ledger.num_slots - 1
    assert ledger.owner_of(tree) == TreeOwner(7)  # type: ignore[arg-type]
    assert ledger.check() == []


def test_double_free_and_out_of_range_raise() -> None:
    ledger = SlotLedger(4)
    slot = ledger.alloc(LIVE)
    assert slot is not None
    ledger.free(slot)
    with pytest.raises(OwnershipError, match="free"):
        ledger.free(slot)
    with pytest.raises(ValueError, match="out of range"):
        ledger.free(0)
    with pytest.raises(ValueError, match="out of range"):
        ledger.owner_of(4)


def test_pending_writer_blocks_moves_until_the_batch_completes() -> None:
    ledger = SlotLedger(4)
    slot = ledger.alloc(KEEP)
    assert slot is not None
    ledger.add_writer(slot, batch_id=7)
    assert not ledger.may_move(slot) and ledger.writers_of(slot) == {7}
    with pytest.raises(OwnershipError, match="pending writer"):
        ledger.free(slot)
    assert ledger.transfer(slot, TreeOwner(3)) is False
    assert ledger.owner_of(slot) == KEEP  # refused: nothing changed
    ledger.relabel(slot, SlotRole.LIVE)  # a role change inside the request is not a move
    assert ledger.owner_of(slot) == LIVE
    assert ledger.check() == []
    assert ledger.complete_batch(7) == [slot]
    assert ledger.may_move(slot) and ledger.transfer(slot, TreeOwner(3))
    assert ledger.owner_of(slot) == TreeOwner(3) and ledger.slots_of("a") == {}


def test_complete_batch_clears_only_that_batch() -> None:
    ledger = SlotLedger(4)
    a, b = ledger.alloc(LIVE), ledger.alloc(KEEP)
    assert a is not None and b is not None
    ledger.add_writer(a, 1)
    ledger.add_writer(b, 1)
    ledger.add_writer(b, 2)
    assert ledger.complete_batch(1) == [a, b]
    assert ledger.may_move(a) and not ledger.may_move(b)
    assert ledger.complete_batch(99) == []  # a batch that wrote no slot is fine
    assert ledger.is_batch_pending(2) and not ledger.is_batch_pending(1)


def test_writers_only_on_request_owned_slots() -> None:
    ledger = SlotLedger(4)
    with pytest.raises(OwnershipError, match="free"):
        ledger.add_writer(1, 0)
    tree = ledger.alloc(TreeOwner(1))
    assert tree is not None
    with pytest.raises(OwnershipError, match="checkpoint"):
        ledger.add_writer(tree, 0)


def test_free_request_is_atomic() -> None:
    ledger = SlotLedger(6)
    live, keep = ledger.alloc(LIVE), ledger.alloc(KEEP)
    assert live is not None and keep is not None
    ledger.add_writer(keep, 3)
    with pytest.raises(OwnershipError, match=str([keep])):
        ledger.free_request("a")
    assert ledger.slots_of("a") == {live: SlotRole.LIVE, keep: SlotRole.KEEP}
    ledger.complete_batch(3)
    assert ledger.free_request("a") == [live, keep]
    assert ledger.num_free == 5 and ledger.check() == []


def test_unguarded_ledger_allows_the_move_and_check_reports_i3() -> None:
    # debug.disable_alias_guard: the move goes through, and the checker sees the aliasing.
    ledger = SlotLedger(4, guard_writers=False)
    slot = ledger.alloc(KEEP)
    assert slot is not None
    ledger.add_writer(slot, 5)
    assert ledger.may_move(slot) and ledger.has_writers(slot)
    assert ledger.transfer(slot, TreeOwner(2))
    assert [v.invariant for v in ledger.check()] == ["I3"]
    ledger.complete_batch(5)
    assert ledger.check() == []


def test_check_detects_a_broken_owner_map() -> None:
    ledger = SlotLedger(4)
    slot = ledger.alloc(LIVE)
    assert slot is not None
    del ledger._owner[slot]  # corrupt: allocated, but nobody owns it
    assert {v.invariant for v in ledger.check()} == {"I2"}
