"""Random operations against the two tiers: a device radix cache whose evictions demote into
a ``HostTier``, and promotions (host -> device copies) that complete or fail at random.

Contents are modelled exactly: every device and host slot holds the token path whose state
it has (``FakeStorage``), copies move those labels, a forced failure writes ``POISON``.
After every step: zero invariant violations on both trees (I1-I9), the host tier's own
checks (I2 pages, I4 labels), the promotions' ledger entries (I3: pending writer of the
destinations, reader of the host source), every checkpoint's slot holding exactly its
path on both tiers (so a failed copy never leaves a node behind), and slot conservation.
A full host tier drops a demotion (``host_full``) instead of blocking.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from workers.cache import Checkpoint, RadixCache, RequestOwner, SlotLedger, SlotRole
from workers.cache.allocators import IdAllocator
from workers.request import Request
from workers.sampling.params import SamplingParams
from workers.stats import EngineStats
from workers.tiers.host_tier import HostTier
from workers.tiers.promotion import PendingPromotion, Promotions

NUM_PAGES, NUM_SLOTS = 20, 7  # device: 19 pages, 6 slots
HOST_PAGES, HOST_SLOTS = 10, 3  # host: 9 pages, 2 slots -- full most of the time
POISON = ("poison",)
INDEX = st.integers(0, 63)
_counts: Counter = Counter()


class FakeJob:
    def __init__(self) -> None:
        self.finished = False
        self.ok = False

    def done(self) -> bool:
        return self.finished

    def result(self) -> bool:
        assert self.finished
        return self.ok


class FakeStorage:
    """Slot contents as token paths; a copy-in runs when the test completes its job."""

    def __init__(self, device_ledger: SlotLedger, host_ledger: SlotLedger) -> None:
        self.device: dict[int, tuple] = {}
        self.host: dict[int, tuple] = {}
        self.device_ledger, self.host_ledger = device_ledger, host_ledger
        self.jobs: list[tuple[FakeJob, int, tuple[int, ...], bool]] = []

    def copy_out(self, slot, pages, host_slot, host_pages, corrupt=False) -> bool:
        assert self.device_ledger.has_readers(slot), "a copy-out must be a reader of its source"
        assert not self.host_ledger.is_free(host_slot)
        self.host[host_slot] = POISON if corrupt else self.device[slot]
        return not corrupt

    def copy_in(self, host_slot, host_pages, slots, pages, corrupt=False) -> FakeJob:
        job = FakeJob()
        self.jobs.append((job, host_slot, tuple(slots), corrupt))
        return job

    def run(self, job: FakeJob, ok: bool) -> None:
        _, host_slot, slots, corrupt = next(j for j in self.jobs if j[0] is job)
        assert self.host_ledger.has_readers(host_slot), "the host source of a copy-in must be read-locked"
        ok = ok and not corrupt
        for s in slots:
            assert self.device_ledger.has_writers(s)
            self.device[s] = self.host[host_slot] if ok else POISON
        job.finished, job.ok = True, ok

    def nbytes(self, num_slots: int, num_pages: int) -> int:
        return num_slots + num_pages


def make_machine(page_size: int, alphabet: int, max_len: int) -> type[RuleBasedStateMachine]:
    tokens = st.lists(st.integers(0, alphabet - 1), min_size=page_size, max_size=max_len)

    class TierMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            _counts["machines"] += 1
            self.ps = page_size
            self.stats = EngineStats()
            self.pages = IdAllocator(NUM_PAGES, "kv")
            self.ledger = SlotLedger(NUM_SLOTS)
            self.host = HostTier(page_size, HOST_PAGES, HOST_SLOTS, self.stats)
            self.storage = FakeStorage(self.ledger, self.host.ledger)
            self.host.storage = self.storage  # type: ignore[assignment]
            self.fail_next = False
            self.host.fails = lambda: self.fail_next  # type: ignore[method-assign]
            self.tree = RadixCache(
                page_size,
                self.pages,
                self.ledger,
                on_drop=lambda node: self._demoted(self.host.demote(self.tree, node)),
            )
            self.promotions = Promotions(self.host, self.ledger)
            self.live: dict[int, tuple[PendingPromotion, FakeJob]] = {}
            self.locks: dict[int, object] = {}  # the device node each promotion locked
            self.next_id = 0

        def _demoted(self, outcome: str) -> None:
            _counts[f"demote:{outcome}"] += 1

        def _new_id(self) -> int:
            self.next_id += 1
            return self.next_id

        def _aligned(self, toks: list[int]) -> tuple[int, ...]:
            return tuple(toks[: len(toks) - len(toks) % self.ps])

        # ---- the device tier ---------------------------------------------------------------
        @rule(toks=tokens, fail=st.booleans())
        def insert_fresh(self, toks: list[int], fail: bool) -> None:
            """A request that prefilled ``toks`` and donates its checkpoint (may demote others)."""
            self.fail_next = fail
            toks = list(self._aligned(toks))
            hit = self.tree.match(toks)
            self.tree.lock(hit.node)
            own = self.tree.alloc_pages(len(toks) // self.ps - len(hit.page_ids))
            slot = None if own is None else self.tree.alloc_slot_evicting(RequestOwner(self._new_id(), SlotRole.KEEP))
            self.tree.unlock(hit.node)
            if own is None or slot is None:
                self.pages.free(own or [])
                return
            self.storage.device[slot] = tuple(toks)
            self.ledger.record_write(slot, len(toks), self._new_id())
            result = self.tree.insert(toks, hit.page_ids + own, Checkpoint.for_tokens(slot, toks, self.ps, 0))
            self.pages.free(result.duplicate_page_ids)
            if result.duplicate_checkpoint:
                self.ledger.free(slot)

        @rule(n=st.integers(1, 6), fail=st.booleans())
        def evict_kv(self, n: int, fail: bool) -> None:
            self.fail_next = fail
            self.tree.evict_kv(n)

        @rule(n=st.integers(1, 3), fail=st.booleans())
        def evict_checkpoints(self, n: int, fail: bool) -> None:
            self.fail_next = fail
            self.tree.evict_checkpoints(n)

        @rule()
        def flush_device(self) -> None:
            before = self.host.tree.num_checkpoints
            self.tree.flush()
            assert self.host.tree.num_checkpoints == before  # a flush demotes nothing

        @rule()
        def flush_host(self) -> None:
            self.host.flush()

        # ---- promotions --------------------------------------------------------------------
        @rule(i=INDEX, more=tokens, fail=st.booleans(), keep=st.booleans())
        def promote(self, i: int, more: list[int], fail: bool, keep: bool) -> None:
            """A prompt that extends a host checkpoint's path (or random tokens when there is none)."""
            self.fail_next = fail
            nodes = [n for n in self.host.tree.iter_nodes() if n.checkpoint is not None]
            base = list(self.host.tree.path_tokens(nodes[i % len(nodes)])) if nodes else []
            toks = list(self._aligned(base + more))
            device = self.tree.match(toks)
            self.tree.lock(device.node)
            plan = self.promotions.plan(toks, device, self.tree.alloc_pages)
            if plan is None:
                self.tree.unlock(device.node)
                return
            assert plan.depth >= device.depth + self.ps and plan.host_node.mamba_lock > 0
            rid = self._new_id()
            live = self.tree.alloc_slot_evicting(RequestOwner(rid, SlotRole.LIVE))
            keep_slot = self.ledger.alloc(RequestOwner(rid, SlotRole.KEEP)) if keep and live else None
            if live is None:
                self.promotions.cancel(plan)
                self.pages.free(plan.page_ids)
                self.tree.unlock(device.node)
                _counts["promote:no_slot"] += 1
                return
            req = Request(f"r{rid}", list(toks), SamplingParams(), handle=rid)
            req.mamba_slot, req.cache.keep_slot = live, keep_slot
            req.page_ids = device.page_ids + plan.page_ids
            pending = self.promotions.start(req, plan, first_lookup=True)
            self.live[rid] = (pending, pending.job)  # type: ignore[assignment]
            self.locks[rid] = device.node

        @precondition(lambda self: self.live)
        @rule(i=INDEX, ok=st.booleans(), publish=st.booleans())
        def complete_copy(self, i: int, ok: bool, publish: bool) -> None:
            """Finish one copy (in any order); ``take_done`` hands them over oldest first."""
            running = sorted(rid for rid, (_, job) in self.live.items() if not job.finished)
            if running:
                self.storage.run(self.live[running[i % len(running)]][1], ok)
            for p, okay in self.promotions.take_done():
                self._finish(p.request.handle, okay, publish)

        def _finish(self, rid: int, ok: bool, publish: bool) -> None:
            pending, _ = self.live.pop(rid)
            req, plan = pending.request, pending.plan
            path = tuple(req.prompt_token_ids[: plan.depth])
            for s in pending.slots:
                want = path if ok else POISON
                assert self.storage.device[s] == want
                assert (self.ledger.content_of(s) is not None) == ok  # content only from a completed copy
            _counts["promote:ok" if ok else "promote:failed"] += 1
            node = self.locks.pop(rid)
            if ok and publish and req.cache.keep_slot is not None:  # back into the device tree
                result = self.tree.insert(
                    list(path),
                    req.page_ids[: plan.depth // self.ps],
                    Checkpoint.for_tokens(req.cache.keep_slot, path, self.ps, 0),
                )
                assert set(result.duplicate_page_ids) <= set(plan.page_ids)
                self.pages.free(result.duplicate_page_ids)
                if result.checkpoint_inserted:
                    self.ledger.free(req.mamba_slot)  # type: ignore[arg-type]
                else:
                    self.ledger.free_request(rid)
            else:
                self.pages.free(plan.page_ids)
                self.ledger.free_request(rid)
            self.tree.unlock(node)

        # ---- after every step --------------------------------------------------------------
        @invariant()
        def consistent(self) -> None:
            _counts["steps"] += 1
            assert self.tree.check_invariants() == []
            assert self.host.check() == []
            assert self.promotions.check() == []
            for tree, content in ((self.tree, self.storage.device), (self.host.tree, self.storage.host)):
                for node in tree.iter_nodes():
                    if node.checkpoint is not None:
                        assert content.get(node.checkpoint.slot) == tree.path_tokens(node), node
            owned = sum(len(p.slots) for p, _ in self.live.values())
            assert self.ledger.num_free + self.tree.num_checkpoints + owned == NUM_SLOTS - 1
            assert self.host.ledger.num_free + self.host.tree.num_checkpoints == HOST_SLOTS - 1

    return TierMachine


# Derandomized: the coverage asserts below (every outcome reached, >= 5k steps) hold for
# most random seeds but not all, so a fixed draw keeps them meaningful.
SETTINGS = settings(
    max_examples=100,
    stateful_step_count=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@pytest.mark.parametrize("page_size, alphabet, max_len", [(1, 3, 8), (2, 2, 10)])
def test_demotions_and_promotions_keep_every_invariant(page_size: int, alphabet: int, max_len: int) -> None:
    before = Counter(_counts)
    run_state_machine_as_test(make_machine(page_size, alphabet, max_len), settings=SETTINGS)
    ran = _counts - before
    steps = ran["steps"] - ran["machines"]
    assert steps >= 5_000, f"only {steps} steps ran"
    # The machine reached every outcome it exists to cover.
    for outcome in ("demote:demoted", "demote:failed", "demote:host_full", "promote:ok", "promote:failed"):
        assert ran[outcome] > 0, (outcome, sorted(ran.items()))
