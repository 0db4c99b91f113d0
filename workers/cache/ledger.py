"""The Mamba slot ownership ledger: one owner per slot, plus the batches that will write it.

State, at every point between calls:
- I2: each slot 1 .. num_slots - 1 is exactly one of: free (in the free list), owned by a
  request (``RequestOwner``: live / keep / pending), or owned by one tree node as its
  checkpoint (``TreeOwner``). Slot 0 is the dummy write target: never handed out, never
  owned, never registered as written. free + request-owned + tree-owned == num_slots - 1.
- I3: ``writers_of(slot)`` are launched batches whose results are not processed yet and
  that will write the slot (a copy into the slot from another tier is such a writer too).
  ``readers_of(slot)`` are transfers copying the slot's content out to another tier that
  have not completed. While a slot has either, its holder may not change: ``free``
  raises, ``transfer`` refuses (returns False) and ``may_move`` is False. A role change
  inside one request (``relabel``, e.g. pending -> keep) is not a change of holder and is
  allowed. A writer may only be registered on a request-owned slot; a reader on any
  owned slot (a tree checkpoint being demoted is the usual one).

Content (I4): ``record_write(slot, depth, batch)`` is called with what the runner reports
it actually wrote, when that batch's result is processed (batches complete in launch
order); ``content_of(slot)`` is then the depth of the state in the slot after every
processed batch. It is the truth for a slot without pending writers (a pending writer
may already have overwritten it); labels elsewhere (keep depths, tree checkpoints) are
taken from it and checked against it. Freeing a slot forgets its content; a transfer
keeps it (the state moves with the slot).

``guard_writers=False`` turns the I3 refusals off (writers are still recorded, and
``check`` reports every writer whose slot changed holder). It exists only so that a test
can show the keep-slot aliasing bug coming back (``debug.disable_alias_guard``). Readers
are always guarded.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Union

from workers.cache.allocators import IdAllocator
from workers.cache.records import Violation


class SlotRole(enum.Enum):
    LIVE = "live"  # the slot the kernels read and advance for a running request
    KEEP = "keep"  # the request's last committed checkpoint, not yet published
    PENDING = "pending"  # a borrowed track slot the next boundary state is written to


@dataclass(frozen=True)
class RequestOwner:
    handle: int  # the engine's handle of the request (never the caller's id)
    role: SlotRole


@dataclass(frozen=True)
class TreeOwner:
    node_id: int


Owner = Union[RequestOwner, TreeOwner]


class SlotContent(NamedTuple):
    """What a slot holds: H(``depth``) of its holder's token path, written by ``batch_id``."""

    depth: int
    batch_id: int


class SlotCounts(NamedTuple):
    num_free: int
    num_live: int
    num_keep: int
    num_pending: int
    num_tree: int

    @property
    def num_request_owned(self) -> int:
        return self.num_live + self.num_keep + self.num_pending


class OwnershipError(RuntimeError):
    """An ownership rule was broken by the caller (double free, free with a pending writer...)."""


def _kind(owner: Owner) -> str:
    return owner.role.value if isinstance(owner, RequestOwner) else "tree"


def same_holder(a: Owner, b: Owner) -> bool:
    """True when ``a`` and ``b`` are the same request (any roles) or the same tree node."""
    if isinstance(a, RequestOwner) and isinstance(b, RequestOwner):
        return a.handle == b.handle
    return a == b


class SlotLedger:
    """Allocator and owner map for Mamba slots; see the module docstring for the rules.

    Mutators: ``alloc``/``alloc_many`` (free -> owned; return None on exhaustion, never
    raise), ``free``/``free_request`` (owned -> free; raise OwnershipError on a double free
    or a pending writer), ``transfer`` (holder change; False when refused for a writer),
    ``relabel`` (role change inside one request), ``add_writer``/``complete_batch``,
    ``add_reader``/``complete_reader`` (transfers out), ``record_write`` (content).
    Slot numbers outside 1 .. num_slots - 1 raise ValueError everywhere.
    """

    def __init__(self, num_slots: int, *, guard_writers: bool = True) -> None:
        self._free = IdAllocator(num_slots, "mamba")
        self.guard_writers = guard_writers
        self._owner: dict[int, Owner] = {}
        self._by_request: dict[int, dict[int, SlotRole]] = {}
        self._content: dict[int, SlotContent] = {}
        self._num_by_kind = {"live": 0, "keep": 0, "pending": 0, "tree": 0}
        # slot -> {batch_id: holder when the batch was registered}; batch_id -> slots.
        self._writers: dict[int, dict[int, Owner]] = {}
        self._batch_slots: dict[int, set[int]] = {}
        # The same for transfers reading slots: slot -> {transfer_id: holder}; id -> slots.
        self._readers: dict[int, dict[int, Owner]] = {}
        self._read_slots: dict[int, set[int]] = {}

    # ---- sizes -------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self._free.size

    @property
    def num_usable(self) -> int:
        return self._free.num_usable

    @property
    def num_free(self) -> int:
        return self._free.num_free

    @property
    def num_tree_owned(self) -> int:
        return self._num_by_kind["tree"]

    @property
    def num_request_owned(self) -> int:
        return len(self._owner) - self._num_by_kind["tree"]

    def counts(self) -> SlotCounts:
        k = self._num_by_kind
        return SlotCounts(self.num_free, k["live"], k["keep"], k["pending"], k["tree"])

    def usage_ratio(self) -> float:
        return self._free.usage_ratio()

    # ---- queries -----------------------------------------------------------------------
    def owner_of(self, slot: int) -> Owner | None:
        """The slot's owner, or None when it is free."""
        self._check_range(slot)
        return self._owner.get(slot)

    def is_free(self, slot: int) -> bool:
        return self.owner_of(slot) is None

    def slots_of(self, handle: int) -> dict[int, SlotRole]:
        """The slots a request owns, with their roles (a copy)."""
        return dict(self._by_request.get(handle, {}))

    def content_of(self, slot: int) -> SlotContent | None:
        """The state the processed batches left in the slot (None: never written since alloc)."""
        self._check_range(slot)
        return self._content.get(slot)

    def writers_of(self, slot: int) -> frozenset[int]:
        self._check_range(slot)
        return frozenset(self._writers.get(slot, ()))

    def has_writers(self, slot: int) -> bool:
        self._check_range(slot)
        return slot in self._writers

    def readers_of(self, slot: int) -> frozenset[int]:
        self._check_range(slot)
        return frozenset(self._readers.get(slot, ()))

    def has_readers(self, slot: int) -> bool:
        self._check_range(slot)
        return slot in self._readers

    def may_move(self, slot: int) -> bool:
        """Whether the slot's holder may change now (free, transfer, donate, insert)."""
        return (not self.guard_writers or not self.has_writers(slot)) and not self.has_readers(slot)

    def is_batch_pending(self, batch_id: int) -> bool:
        return batch_id in self._batch_slots

    # ---- ownership ---------------------------------------------------------------------
    def alloc(self, owner: Owner) -> int | None:
        """A free slot now owned by ``owner``; None when none is free (never evicts)."""
        slot = self._free.alloc_one()
        if slot is not None:
            self._set_owner(slot, owner)
        return slot

    def alloc_many(self, owners: Sequence[Owner]) -> list[int] | None:
        """One slot per owner, all or nothing (atomic admission); None when short."""
        slots = self._free.alloc(len(owners))
        if slots is not None:
            for slot, owner in zip(slots, owners):
                self._set_owner(slot, owner)
        return slots

    def free(self, slot: int) -> None:
        owner = self._owned(slot, "free")
        if not self.may_move(slot):
            raise OwnershipError(
                f"free of slot {slot} ({owner}) with pending writer batches "
                f"{sorted(self._writers.get(slot, ()))} / readers {sorted(self._readers.get(slot, ()))}"
            )
        self._clear_owner(slot)
        self._content.pop(slot, None)
        self._free.free([slot])

    def free_request(self, handle: int) -> list[int]:
        """Free every slot the request owns; raises before freeing any if one has a writer."""
        slots = sorted(self._by_request.get(handle, {}))
        busy = [s for s in slots if not self.may_move(s)]
        if busy:
            raise OwnershipError(f"request {handle!r}: slots {busy} have pending writers")
        for slot in slots:
            self.free(slot)
        return slots

    def transfer(self, slot: int, new_owner: Owner) -> bool:
        """Give the slot to ``new_owner``; False (nothing changes) while a writer is pending."""
        owner = self._owned(slot, "transfer")
        if owner == new_owner:
            return True
        if not same_holder(owner, new_owner) and not self.may_move(slot):
            return False
        self._clear_owner(slot)
        self._set_owner(slot, new_owner)
        return True

    def relabel(self, slot: int, role: SlotRole) -> None:
        """Change the role of a request-owned slot within its request (allowed with writers)."""
        owner = self._owned(slot, "relabel")
        if not isinstance(owner, RequestOwner):
            raise OwnershipError(f"relabel of slot {slot}: owned by {owner}, not a request")
        self.transfer(slot, RequestOwner(owner.handle, role))

    # ---- pending writers ---------------------------------------------------------------
    def add_writer(self, slot: int, batch_id: int) -> None:
        """Record that launched batch ``batch_id`` will write ``slot`` (request-owned only)."""
        owner = self._owned(slot, "add_writer")
        if isinstance(owner, TreeOwner) and self.guard_writers:
            raise OwnershipError(
                f"batch {batch_id} may not write slot {slot}: it is tree node {owner.node_id}'s checkpoint"
            )
        self._writers.setdefault(slot, {})[batch_id] = owner
        self._batch_slots.setdefault(batch_id, set()).add(slot)

    def add_writers(self, slots: Iterable[int], batch_id: int) -> None:
        """``add_writer`` for each slot (one pass; a refused slot raises as there)."""
        batch = self._batch_slots.setdefault(batch_id, set())
        for slot in slots:
            owner = self._owner.get(slot)
            if owner is None or (self.guard_writers and isinstance(owner, TreeOwner)):
                self.add_writer(slot, batch_id)  # raises, naming the slot
            self._writers.setdefault(slot, {})[batch_id] = owner
            batch.add(slot)

    def complete_batch(self, batch_id: int) -> list[int]:
        """The batch's result is processed: drop it from every slot's writers.

        Returns the slots it was registered on (sorted); an unknown batch is a no-op.
        """
        return _drop_entry(self._writers, self._batch_slots, batch_id)

    # ---- readers (transfers out of a slot) ----------------------------------------------
    def add_reader(self, slot: int, transfer_id: int) -> None:
        """Record that transfer ``transfer_id`` copies the slot's content out until
        ``complete_reader``; meanwhile the slot may not change holder or be freed."""
        owner = self._owned(slot, "add_reader")
        self._readers.setdefault(slot, {})[transfer_id] = owner
        self._read_slots.setdefault(transfer_id, set()).add(slot)

    def complete_reader(self, transfer_id: int) -> list[int]:
        """The transfer has read what it copies: drop it from every slot's readers."""
        return _drop_entry(self._readers, self._read_slots, transfer_id)

    # ---- content -----------------------------------------------------------------------
    def record_write(self, slot: int, depth: int, batch_id: int) -> None:
        """A processed batch wrote H(``depth``) into an owned slot (what the runner reports)."""
        self._owned(slot, "record_write")
        self._content[slot] = SlotContent(depth, batch_id)

    def record_owned_writes(self, writes: Iterable[tuple[int, int]], batch_id: int) -> None:
        """``record_write`` for each (slot, depth) whose slot is still owned (a discarded
        request's slots may be gone: those are skipped)."""
        owner, content = self._owner, self._content
        for slot, depth in writes:
            if slot in owner:
                content[slot] = SlotContent(depth, batch_id)

    # ---- invariants --------------------------------------------------------------------
    def check(self) -> list[Violation]:
        """I2 (exclusive ownership, conservation) and I3 (no holder change under a writer
        or a reader)."""
        return (
            _check_ownership(self)
            + _check_pending(self, self._writers, self._batch_slots, "batch")
            + _check_pending(self, self._readers, self._read_slots, "reading transfer")
        )

    # ---- internals ---------------------------------------------------------------------
    def _check_range(self, slot: int) -> None:
        if not 0 < slot < self.num_slots:
            raise ValueError(f"mamba slot {slot} out of range 1..{self.num_slots - 1}")

    def _owned(self, slot: int, action: str) -> Owner:
        owner = self.owner_of(slot)
        if owner is None:
            raise OwnershipError(f"{action} of slot {slot}, which is free")
        return owner

    def _set_owner(self, slot: int, owner: Owner) -> None:
        if not isinstance(owner, (RequestOwner, TreeOwner)):
            raise TypeError(f"owner must be RequestOwner or TreeOwner, got {owner!r}")
        self._owner[slot] = owner
        self._num_by_kind[_kind(owner)] += 1
        if isinstance(owner, RequestOwner):
            self._by_request.setdefault(owner.handle, {})[slot] = owner.role

    def _clear_owner(self, slot: int) -> None:
        owner = self._owner.pop(slot)
        self._num_by_kind[_kind(owner)] -= 1
        if isinstance(owner, RequestOwner):
            slots = self._by_request[owner.handle]
            del slots[slot]
            if not slots:
                del self._by_request[owner.handle]


def _check_ownership(ledger: SlotLedger) -> list[Violation]:
    out: list[Violation] = []
    for slot in range(1, ledger.num_slots):
        is_free, owner = ledger._free.is_free(slot), ledger._owner.get(slot)
        if is_free == (owner is not None):
            out.append(Violation("I2", f"slot {slot}: free list says free={is_free}, owner map says {owner}"))
    total = ledger.num_free + ledger.num_request_owned + ledger.num_tree_owned
    if total != ledger.num_usable:
        out.append(
            Violation(
                "I2",
                f"free {ledger.num_free} + request {ledger.num_request_owned} + tree "
                f"{ledger.num_tree_owned} = {total} != {ledger.num_usable} usable slots",
            )
        )
    kinds = {"live": 0, "keep": 0, "pending": 0, "tree": 0}
    for owner in ledger._owner.values():
        kinds[_kind(owner)] += 1
    if kinds != ledger._num_by_kind:
        out.append(Violation("I2", f"per-kind counts {ledger._num_by_kind} != recount {kinds}"))
    indexed = {(h, s, role) for h, slots in ledger._by_request.items() for s, role in slots.items()}
    actual = {(o.handle, s, o.role) for s, o in ledger._owner.items() if isinstance(o, RequestOwner)}
    if indexed != actual:
        out.append(Violation("I2", f"request index disagrees with owner map: {sorted(indexed ^ actual, key=str)}"))
    stray = sorted(s for s in ledger._content if s not in ledger._owner)
    if stray:
        out.append(Violation("I4", f"content recorded for free slots {stray}"))
    return out


def _drop_entry(by_slot: dict[int, dict[int, Owner]], by_id: dict[int, set[int]], entry_id: int) -> list[int]:
    """Remove one writer or reader from both maps; returns its slots (sorted)."""
    slots = by_id.pop(entry_id, set())
    for slot in slots:
        entries = by_slot[slot]
        del entries[entry_id]
        if not entries:
            del by_slot[slot]
    return sorted(slots)


def _check_pending(
    ledger: SlotLedger, by_slot: dict[int, dict[int, Owner]], by_id: dict[int, set[int]], what: str
) -> list[Violation]:
    out: list[Violation] = []
    index: dict[int, set[int]] = {}
    for slot, entries in by_slot.items():
        if not entries:
            out.append(Violation("I3", f"slot {slot}: empty {what} entry"))
        owner = ledger._owner.get(slot)
        for entry_id, registered in entries.items():
            index.setdefault(entry_id, set()).add(slot)
            if owner is None or not same_holder(registered, owner):
                out.append(
                    Violation(
                        "I3",
                        f"slot {slot} changed holder from {registered} to {owner} while {what} {entry_id} is pending",
                    )
                )
    if index != by_id:
        out.append(Violation("I3", f"{what} index {by_id} != slot map {index}"))
    return out
