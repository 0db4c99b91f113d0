"""``CacheManager.check_invariants``: the pools and the requests against each other.

Recounts from scratch (for tests and ``debug.check_invariants``):
- I1-I3, I6-I9: the ledger's and the tree's own checks.
- I2 (pages): free + tree + the held requests' own pages + deferred frees == usable; every
  running request owns exactly one live slot, the one it names.
- I4 (labels): every label agrees with the ledger's content record, i.e. with what the
  runner reported writing -- a tree checkpoint's depth, a request's keep depth, and a
  running request's computed length for its live slot -- wherever no pending writer can
  still change the slot.
"""

from __future__ import annotations

from collections.abc import Sequence

from workers.cache import RadixCache, SlotLedger, SlotRole, Violation
from workers.cache.allocators import IdAllocator
from workers.request import Request


def check_pools(
    ledger: SlotLedger,
    tree: RadixCache | None,
    pages: IdAllocator,
    running: Sequence[Request],
    held: Sequence[Request],
    deferred_pages: int,
) -> list[Violation]:
    out = list(ledger.check())
    if tree is not None:
        out += [v for v in tree.check_invariants() if v not in out]
    out += _check_pages(tree, pages, held, deferred_pages)
    out += _check_live_slots(ledger, running)
    out += _check_tree_labels(ledger, tree)
    out += _check_request_labels(ledger, running)
    return out


def _check_pages(
    tree: RadixCache | None, pages: IdAllocator, held: Sequence[Request], deferred: int
) -> list[Violation]:
    own = sum(len(r.page_ids) - r.cache.num_tree_pages for r in held)
    tree_pages = tree.num_cached_pages if tree is not None else 0
    if pages.num_free + tree_pages + own + deferred == pages.num_usable:
        return []
    return [
        Violation(
            "I2",
            f"KV pages: free {pages.num_free} + tree {tree_pages} + requests {own} + "
            f"deferred {deferred} != {pages.num_usable}",
        )
    ]


def _check_live_slots(ledger: SlotLedger, running: Sequence[Request]) -> list[Violation]:
    out = []
    for r in running:
        roles = ledger.slots_of(r.handle)
        if list(roles.values()).count(SlotRole.LIVE) != 1 or roles.get(r.mamba_slot) is not SlotRole.LIVE:
            out.append(Violation("I2", f"request {r.request_id}: live slot {r.mamba_slot}, ledger {roles}"))
    return out


def _check_tree_labels(ledger: SlotLedger, tree: RadixCache | None) -> list[Violation]:
    out: list[Violation] = []
    if tree is None:
        return out
    for node in tree.iter_nodes():
        ckpt = node.checkpoint
        if ckpt is None or ledger.has_writers(ckpt.slot):
            continue
        content = ledger.content_of(ckpt.slot)
        if content is None or content.depth != ckpt.depth:
            out.append(Violation("I4", f"node at depth {node.depth}: its slot {ckpt.slot} holds {content}"))
    return out


def _check_request_labels(ledger: SlotLedger, running: Sequence[Request]) -> list[Violation]:
    out: list[Violation] = []
    for r in running:
        c = r.cache
        if c.keep_slot is not None and c.keep_depth is not None and not ledger.has_writers(c.keep_slot):
            content = ledger.content_of(c.keep_slot)
            if content is None or content.depth != c.keep_depth:
                out.append(
                    Violation(
                        "I4", f"request {r.request_id}: keep depth {c.keep_depth}, slot {c.keep_slot} holds {content}"
                    )
                )
        live = r.mamba_slot
        if (
            live is None
            or r.inflight_batch is not None
            or c.cow_src is not None
            or r.num_computed_tokens == 0
            or ledger.has_writers(live)
        ):
            continue
        content = ledger.content_of(live)
        if content is None or content.depth != r.num_computed_tokens:
            out.append(
                Violation(
                    "I4",
                    f"request {r.request_id}: computed {r.num_computed_tokens} tokens, "
                    f"live slot {live} holds {content}",
                )
            )
    return out
