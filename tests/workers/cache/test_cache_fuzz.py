"""Random operations against the radix cache and the ledger, with a model of the requests.

The machine plays a small engine: requests match, lock, allocate pages and slots, grow,
donate keep slots to the tree (at their end or at a shorter page boundary, which splits
edges), launch batches that write their slots, finish; the tree is queried, evicted and
flushed in between. After every step: zero invariant violations, slot and page
conservation against the model, locked checkpoints untouched, writers as launched.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from workers.cache import (
    Checkpoint,
    InsertResult,
    MatchResult,
    OwnershipError,
    RadixCache,
    RequestOwner,
    SlotLedger,
    SlotRole,
    TreeNode,
    TreeOwner,
)
from workers.cache.allocators import IdAllocator

NUM_PAGES = 24  # 23 usable: eviction pressure is constant
NUM_SLOTS = 9  # 8 usable: 3 requests x (live + keep) leave 2 for the tree
MAX_REQUESTS = 3
INDEX = st.integers(0, 63)
_counts = {"steps": 0, "machines": 0}


@dataclass
class Req:
    rid: str
    tokens: list[int]
    page_ids: list[int]  # one per whole page of tokens: the tree's below the lock, then own
    own: set[int]  # pages this request owns (allocated and not adopted by the tree)
    live: int
    keep: int | None
    lock: TreeNode  # the deepest node it locked on its path (the root on a miss)
    lock_checkpoint: Checkpoint | None


def make_machine(page_size: int, alphabet: int, max_len: int) -> type[RuleBasedStateMachine]:
    tokens = st.lists(st.integers(0, alphabet - 1), max_size=max_len)

    class CacheMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            _counts["machines"] += 1
            self.ps = page_size
            self.pages = IdAllocator(NUM_PAGES, "kv")
            self.ledger = SlotLedger(NUM_SLOTS)
            self.cache = RadixCache(page_size, self.pages, self.ledger)
            self.reqs: dict[str, Req] = {}
            self.held: list[tuple[TreeNode, Checkpoint | None]] = []  # locks taken by the test itself
            self.pending: set[int] = set()
            self.next_id = 0

        # ---- helpers -------------------------------------------------------------------
        def _new_id(self) -> int:
            self.next_id += 1
            return self.next_id

        def _pick(self, i: int) -> Req:
            return self.reqs[sorted(self.reqs)[i % len(self.reqs)]]

        def _snapshot(self) -> tuple[int, ...]:
            c = self.cache
            return (c.num_nodes, c.num_cached_pages, c.num_checkpoints, self.pages.num_free, self.ledger.num_free)

        def _checked_match(self, toks: list[int]) -> MatchResult:
            """match, compared with a brute-force oracle over all node paths."""
            paths = {n.node_id: self.cache.path_tokens(n) for n in self.cache.iter_nodes()}
            expected = max(
                (
                    n.depth
                    for n in self.cache.iter_nodes()
                    if n.checkpoint is not None and paths[n.node_id] == tuple(toks[: n.depth])
                ),
                default=0,
            )
            hit = self.cache.match(toks)
            assert hit.depth == expected and hit.depth <= hit.kv_depth <= len(toks) - len(toks) % self.ps
            if hit.depth == 0:
                assert hit.node is self.cache.root and hit.checkpoint is None and hit.page_ids == []
            else:  # never a depth without a checkpoint
                assert hit.checkpoint is not None and hit.checkpoint is hit.node.checkpoint
                assert hit.checkpoint.depth == hit.depth
                assert paths[hit.node.node_id] == tuple(toks[: hit.depth])
                assert len(hit.page_ids) == hit.depth // self.ps
            return hit

        def _adopt(self, req: Req, depth: int, result: InsertResult) -> None:
            """Switch the request's table to the tree's pages; free what the tree did not take."""
            k = depth // self.ps
            adopted = 0
            for old, canonical in zip(req.page_ids[:k], result.page_ids):
                if old == canonical:
                    adopted += old in req.own
                    req.own.discard(old)
                else:  # a duplicate: still ours, and nothing in flight reads it in this model
                    assert old in req.own and old in result.duplicate_page_ids
                    req.own.remove(old)
                    self.pages.free([old])
            assert adopted == result.num_new_pages and len(result.page_ids) == k
            req.page_ids[:k] = result.page_ids

        def _publish(self, req: Req, depth: int) -> None:
            """Donate the keep slot as the checkpoint at ``depth`` (a prefix of the request)."""
            assert req.keep is not None
            toks, pages = req.tokens[:depth], req.page_ids[: depth // self.ps]
            ckpt = Checkpoint.for_tokens(req.keep, toks, self.ps, self._new_id())
            duplicate = self.cache.peek(toks).depth == depth  # the slot would not be taken
            if not self.ledger.may_move(req.keep) and not duplicate:
                before = self._snapshot()
                with pytest.raises(OwnershipError):
                    self.cache.insert(toks, pages, ckpt)
                assert self._snapshot() == before  # refused before any mutation
                return
            result = self.cache.insert(toks, pages, ckpt)
            assert result.duplicate_checkpoint == duplicate
            self._adopt(req, depth, result)
            if result.checkpoint_inserted:
                assert self.ledger.owner_of(ckpt.slot) == TreeOwner(result.node.node_id)
                req.keep = self.ledger.alloc(RequestOwner(req.rid, SlotRole.KEEP))  # optional
            else:
                assert result.duplicate_checkpoint
                assert self.ledger.owner_of(ckpt.slot) == RequestOwner(req.rid, SlotRole.KEEP)
            if result.node.depth >= req.lock.depth:  # move the lock down the path
                self.cache.lock(result.node)
                self.cache.unlock(req.lock)
                req.lock, req.lock_checkpoint = result.node, result.node.checkpoint

        # ---- requests ------------------------------------------------------------------
        @precondition(lambda self: len(self.reqs) < MAX_REQUESTS)
        @rule(toks=tokens)
        def start(self, toks: list[int]) -> None:
            rid = f"r{self._new_id()}"
            hit = self._checked_match(toks)
            self.cache.lock(hit.node)  # before allocating: eviction must spare the hit
            own = self.cache.alloc_pages(len(toks) // self.ps - len(hit.page_ids))
            live = None if own is None else self.cache.alloc_slot_evicting(RequestOwner(rid, SlotRole.LIVE))
            if own is None or live is None:
                self.pages.free(own or [])
                self.cache.unlock(hit.node)
                return
            assert hit.node.alive and hit.node.checkpoint is hit.checkpoint
            keep = self.ledger.alloc(RequestOwner(rid, SlotRole.KEEP))
            self.reqs[rid] = Req(rid, list(toks), hit.page_ids + own, set(own), live, keep, hit.node, hit.checkpoint)

        @precondition(lambda self: self.reqs)
        @rule(i=INDEX, more=tokens)
        def extend(self, i: int, more: list[int]) -> None:
            req = self._pick(i)
            num_pages = (len(req.tokens) + len(more)) // self.ps - len(req.page_ids)
            got = self.cache.alloc_pages(num_pages)
            if got is not None:
                req.tokens += more
                req.page_ids += got
                req.own |= set(got)

        @precondition(lambda self: self.reqs)
        @rule(i=INDEX, cut=INDEX)
        def donate(self, i: int, cut: int) -> None:
            req = self._pick(i)
            if req.keep is not None and req.page_ids:
                self._publish(req, (cut % len(req.page_ids) + 1) * self.ps)

        @precondition(lambda self: self.reqs)
        @rule(i=INDEX, cut=INDEX)
        def insert_kv_only(self, i: int, cut: int) -> None:
            req = self._pick(i)
            if not req.page_ids:
                return
            depth = (cut % len(req.page_ids) + 1) * self.ps
            toks, pages = req.tokens[:depth], req.page_ids[: depth // self.ps]
            if self.cache.peek(toks).kv_depth < depth:  # would end in a tombstone leaf
                before = self._snapshot()
                with pytest.raises(ValueError, match="I6"):
                    self.cache.insert(toks, pages, None)
                assert self._snapshot() == before
                return
            result = self.cache.insert(toks, pages, None)
            assert result.num_new_pages == 0 and not result.checkpoint_inserted
            assert result.duplicate_page_ids == [p for p in pages if p in req.own]  # still ours

        @precondition(lambda self: self.reqs)
        @rule(i=INDEX, with_keep=st.booleans())
        def launch(self, i: int, with_keep: bool) -> None:
            req, batch_id = self._pick(i), self._new_id()
            self.ledger.add_writer(req.live, batch_id)
            if with_keep and req.keep is not None:
                self.ledger.add_writer(req.keep, batch_id)
            self.pending.add(batch_id)

        @precondition(lambda self: self.pending)
        @rule(j=INDEX)
        def complete(self, j: int) -> None:
            batch_id = sorted(self.pending)[j % len(self.pending)]
            assert self.ledger.complete_batch(batch_id)
            self.pending.remove(batch_id)

        @precondition(lambda self: self.reqs)
        @rule(i=INDEX, publish=st.booleans())
        def finish(self, i: int, publish: bool) -> None:
            req = self._pick(i)
            if not all(self.ledger.may_move(s) for s in self.ledger.slots_of(req.rid)):
                with pytest.raises(OwnershipError):
                    self.ledger.free_request(req.rid)  # the engine waits for the batch instead
                return
            if publish and req.keep is not None and req.page_ids:
                self._publish(req, len(req.page_ids) * self.ps)
            self.cache.unlock(req.lock)
            self.pages.free(sorted(req.own))
            self.ledger.free_request(req.rid)
            del self.reqs[req.rid]

        @rule(toks=tokens)
        def insert_fresh(self, toks: list[int]) -> None:
            """A request that prefilled and finished in one step."""
            toks = toks[: len(toks) - len(toks) % self.ps]
            pages = self.cache.alloc_pages(len(toks) // self.ps) if toks else None
            slot = self.ledger.alloc(RequestOwner("fresh", SlotRole.KEEP)) if pages is not None else None
            if pages is None or slot is None:
                self.pages.free(pages or [])
                return
            result = self.cache.insert(toks, pages, Checkpoint.for_tokens(slot, toks, self.ps, self._new_id()))
            self.pages.free(result.duplicate_page_ids)
            if result.duplicate_checkpoint:
                self.ledger.free(slot)

        # ---- the tree ------------------------------------------------------------------
        @rule(toks=tokens)
        def query(self, toks: list[int]) -> None:
            self._checked_match(toks)

        @rule(toks=tokens)
        def lock_hit(self, toks: list[int]) -> None:
            hit = self._checked_match(toks)
            if hit.depth:
                self.cache.lock(hit.node)
                self.held.append((hit.node, hit.checkpoint))

        @precondition(lambda self: self.held)
        @rule(j=INDEX)
        def unlock_hit(self, j: int) -> None:
            node, _ = self.held.pop(j % len(self.held))
            self.cache.unlock(node)

        @rule(n=st.integers(1, 8))
        def evict_kv(self, n: int) -> None:
            before = self._snapshot()
            freed = self.cache.evict_kv(n)
            assert freed.num_pages >= n or self.cache.num_evictable_pages == 0
            self._assert_freed(before, freed.num_pages, freed.num_checkpoints)

        @rule(n=st.integers(1, 4))
        def evict_checkpoints(self, n: int) -> None:
            before, evictable = self._snapshot(), self.cache.num_evictable_checkpoints
            freed = self.cache.evict_checkpoints(n)
            assert freed.num_checkpoints == min(n, evictable)
            self._assert_freed(before, freed.num_pages, freed.num_checkpoints)

        @rule()
        def flush(self) -> None:
            self.cache.flush()
            assert self.cache.num_evictable_pages == 0 and self.cache.num_evictable_checkpoints == 0
            if not self.reqs and not self.held:
                assert self.cache.num_nodes == 0 and self.pages.num_free == NUM_PAGES - 1
                assert self.ledger.num_free == NUM_SLOTS - 1

        def _assert_freed(self, before: tuple[int, ...], pages: int, checkpoints: int) -> None:
            nodes, cached, ckpts, free_pages, free_slots = before
            after = self._snapshot()
            assert after[1:] == (cached - pages, ckpts - checkpoints, free_pages + pages, free_slots + checkpoints)

        # ---- after every step ----------------------------------------------------------
        @invariant()
        def consistent(self) -> None:
            _counts["steps"] += 1
            assert self.cache.check_invariants() == []
            self._check_slots()
            self._check_pages()
            for node, ckpt in self.held + [(r.lock, r.lock_checkpoint) for r in self.reqs.values()]:
                assert node.alive and node.checkpoint is ckpt  # locked checkpoints are never freed
            assert set(self.ledger._batch_slots) == self.pending

        def _check_slots(self) -> None:
            counts = self.ledger.counts()
            assert counts.num_free + counts.num_request_owned + counts.num_tree == NUM_SLOTS - 1
            assert counts.num_tree == self.cache.num_checkpoints
            model = {}
            for req in self.reqs.values():
                model[req.live] = RequestOwner(req.rid, SlotRole.LIVE)
                if req.keep is not None:
                    model[req.keep] = RequestOwner(req.rid, SlotRole.KEEP)
            owned = {s: self.ledger.owner_of(s) for s in range(1, NUM_SLOTS)}
            assert {s: o for s, o in owned.items() if isinstance(o, RequestOwner)} == model

        def _check_pages(self) -> None:
            free = [p for p in range(1, NUM_PAGES) if self.pages.is_free(p)]
            tree = [p for n in self.cache.iter_nodes() for p in n.page_ids]
            own = [p for r in self.reqs.values() for p in r.own]
            assert sorted(free + tree + own) == list(range(1, NUM_PAGES))  # no leak, no double owner
            for req in self.reqs.values():
                k = req.lock.depth // self.ps
                path: list[int] = []
                node = req.lock
                while not node.is_root:
                    path[:0] = node.page_ids
                    node = node.parent  # type: ignore[assignment]
                assert req.page_ids[:k] == path and set(req.page_ids[k:]) == req.own
                assert len(req.page_ids) == len(req.tokens) // self.ps

    return CacheMachine


SETTINGS = settings(
    max_examples=100,
    stateful_step_count=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@pytest.mark.parametrize("page_size, alphabet, max_len", [(1, 3, 8), (2, 2, 10)])
def test_random_operations_keep_every_invariant(page_size: int, alphabet: int, max_len: int) -> None:
    before = dict(_counts)
    run_state_machine_as_test(make_machine(page_size, alphabet, max_len), settings=SETTINGS)
    steps = (_counts["steps"] - before["steps"]) - (_counts["machines"] - before["machines"])
    assert steps >= 5_000, f"only {steps} steps ran"  # two page sizes: >= 10,000 in total
