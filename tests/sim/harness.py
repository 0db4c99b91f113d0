"""The deterministic simulation harness: a real Engine (scheduler, pools, radix tree, ledger,
checkpoint tracker, result processing, overlap lag) driven step by step over ``ToyRunner``,
with oracles checked after every step.

After each ``engine.step()`` the harness waits until the forward thread has executed every
launched batch. That changes nothing the engine decides (a launched batch's writes are fixed
by its frozen plan and prepared rows, and the scheduler thread never touches slot contents),
but it makes every slot's content final, so the oracles read a deterministic state:

- I1 (toy): every tree node with a checkpoint holds exactly H(node depth) of its path. A node
  that does not is an *aliased donation*: its slot was given to the tree while a launched
  batch wrote something else into it (or it was labelled with the wrong depth). With the
  host tier on (``toy_tiers``), the host tree's nodes are checked against the host pool
  the same way (a demotion that copied the wrong slot, or kept a failed copy).
- I2/I3/I6-I9: ``engine.check_invariants()`` (bookkeeping), counted per invariant.
- I4 (toy): a running request's keep label names the state in its keep slot (checked when
  no launched batch still writes the slot), and its live slot holds the state after its
  computed tokens (checked when none of its batches is in flight).
- corruptions: a step started from a live state that is not the request's true prefix.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from configs.schema import load_config
from tests.sim.toy import AcceptScript, ToyRunner, ToyState, ToyVocab, chain, default_script
from tests.sim.toy_tiers import install_toy_tiers
from workers.cache import CheckpointInserted
from workers.engine import Engine
from workers.outputs import EngineOutput
from workers.sampling.params import SamplingParams


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        nested = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merge(out[key], value) if nested else value
    return out


@dataclass(frozen=True)
class Finished:
    """A request's whole output, gathered from the engine's deltas (the sims need no text)."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None
    cached_tokens: int
    finished: bool = True


class TokenLog:
    """Token ids per request from ``EngineOutput`` deltas; ``feed`` returns the finished."""

    def __init__(self) -> None:
        self._ids: dict[str, list[int]] = {}

    def feed(self, outputs: Sequence[EngineOutput | None]) -> list[Finished]:
        done = []
        for out in outputs:
            if out is None:
                continue
            ids = self._ids.setdefault(out.request_id, [])
            ids.extend(out.new_token_ids)
            if out.finished:
                done.append(
                    Finished(out.request_id, self._ids.pop(out.request_id), out.finish_reason, out.cached_tokens)
                )
        return done


@dataclass(frozen=True)
class Alias:
    node_id: int
    slot: int
    node_depth: int
    held_depth: int
    batch_id: int  # the batch the checkpoint record says produced it


@dataclass
class Oracles:
    aliased: dict[tuple[int, int, int], Alias] = field(default_factory=dict)
    host_aliased: dict[tuple[int, int, int], Alias] = field(default_factory=dict)  # host tier nodes
    violations: Counter = field(default_factory=Counter)  # invariant -> distinct messages
    violation_messages: set[tuple[str, str]] = field(default_factory=set)
    keep_label_mismatches: list[tuple[int, str, int, int]] = field(default_factory=list)
    live_mismatches: list[tuple[int, str, int, int]] = field(default_factory=list)
    inserted: list[CheckpointInserted] = field(default_factory=list)
    steps: int = 0
    node_checks: int = 0  # checkpoint nodes whose slot content was compared (I1 oracle)

    @property
    def num_aliased(self) -> int:
        return len(self.aliased) + len(self.host_aliased)


class Sim:
    """One engine on the toy model. ``overrides`` are config fields (nested dicts)."""

    def __init__(
        self, model_dir, overrides: dict[str, Any] | None = None, script: AcceptScript = default_script
    ) -> None:
        base = {
            "model": str(model_dir),
            "device": "cpu",
            "dtype": "float32",
            "cache": {"max_kv_tokens": 16384},
            "scheduler": {"overlap": True},
            "debug": {"check_invariants": False},
        }  # the harness checks them itself
        self.config = load_config(overrides=_merge(base, overrides or {}))
        self.engine = Engine(self.config)
        self.engine.record_cache_events()
        self.runner = ToyRunner.install(self.engine, script)
        self.host_storage = install_toy_tiers(self.engine, self.runner)
        self.vocab: ToyVocab = self.runner.vocab
        self.oracles = Oracles()
        self._node_state: dict[int, ToyState] = {}
        self._host_state: dict[int, ToyState] = {}
        self._ids = 0
        self.log = TokenLog()

    def close(self) -> None:
        self.runner.shutdown()

    # -- driving -----------------------------------------------------------------------------
    def __enter__(self) -> Sim:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        on_step: Callable[[Sim, list[str]], list[Finished] | None] | None = None,
    ) -> list[Finished]:
        """Submit every prompt at once and step to completion; outputs in prompt order.

        ``on_step(sim, request_ids)`` runs before every step and may abort requests
        (``abort``), returning their final outputs.
        """
        e = self.engine
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        order: dict[str, int] = {}
        for i, (p, sp) in enumerate(zip(prompts, plist)):
            rid = f"sim-{self._ids}"
            self._ids += 1
            e.add_request(rid, list(p), sp)
            order[rid] = i
        results: list[Finished | None] = [None] * len(prompts)
        while e.has_unfinished():
            if on_step is not None:
                for out in on_step(self, list(order)) or []:
                    results[order[out.request_id]] = out
            for out in self.step():
                if out.finished and out.request_id in order:
                    results[order[out.request_id]] = out
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    def step(self) -> list[Finished]:
        outputs = self.engine.step()
        for launched in self.engine._launched:
            launched.future.result()  # every launched batch has executed
        self.check()
        return self.log.feed(outputs)

    def abort(self, request_id: str) -> Finished | None:
        done = self.log.feed([self.engine.abort(request_id)])
        return done[0] if done else None

    # -- oracles -----------------------------------------------------------------------------
    def check(self) -> None:
        o, e = self.oracles, self.engine
        o.steps += 1
        o.inserted += [ev for ev in e.drain_cache_events() if isinstance(ev, CheckpointInserted)]
        for v in e.check_invariants():
            if (v.invariant, v.message) not in o.violation_messages:
                o.violation_messages.add((v.invariant, v.message))
                o.violations[v.invariant] += 1
        pool, tree, ledger = self.runner.pool, e.cache.tree, e.slot_ledger
        if tree is not None:
            self._check_tree(tree, pool, self._node_state, o.aliased)
        if e.cache.host is not None and self.host_storage is not None:
            self._check_tree(e.cache.host.tree, self.host_storage.host_pool, self._host_state, o.host_aliased)
        for req in e.scheduler.running:
            c = req.cache
            if c.keep_depth is not None and c.keep_slot is not None and not ledger.has_writers(c.keep_slot):
                if pool[c.keep_slot] != chain(req.token_slice(0, c.keep_depth)):
                    o.keep_label_mismatches.append((o.steps, req.request_id, c.keep_depth, pool[c.keep_slot].depth))
            if (
                req.inflight_batch is None
                and req.mamba_slot is not None
                and req.num_computed_tokens > 0
                and c.cow_src is None
                and c.promotion is None
            ):  # else the live slot is not written yet
                if pool[req.mamba_slot] != chain(req.token_slice(0, req.num_computed_tokens)):
                    o.live_mismatches.append(
                        (o.steps, req.request_id, req.num_computed_tokens, pool[req.mamba_slot].depth)
                    )

    def _check_tree(self, tree, pool, known: dict[int, ToyState], aliased: dict) -> None:
        """I1 on data: every checkpoint node's slot holds exactly H(its path)."""
        for node in tree.iter_nodes():
            ckpt = node.checkpoint
            if ckpt is None:
                continue
            self.oracles.node_checks += 1
            true = known.get(node.node_id)
            if true is None:
                true = known[node.node_id] = chain(tree.path_tokens(node))
            held = pool[ckpt.slot]
            if held != true:
                key = (node.node_id, ckpt.slot, ckpt.batch_id)
                aliased.setdefault(key, Alias(node.node_id, ckpt.slot, node.depth, held.depth, ckpt.batch_id))

    # -- reading results ---------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return self.engine.stats.snapshot()

    def skipped_donations(self) -> int:
        return sum(self.stats()["hybridserve_mamba_donations_skipped_total"].values())

    def pending_alloc_failures(self) -> int:
        return self.stats()["hybridserve_mamba_pending_alloc_failures_total"]

    def inserted_at(self, tokens: Sequence[int]) -> bool:
        """Whether a checkpoint for exactly ``tokens`` was ever inserted into the tree."""
        t = tuple(tokens)
        return any(ev.depth == len(t) and ev.token_ids == t for ev in self.oracles.inserted)

    def summary(self) -> dict[str, Any]:
        s = self.stats()
        return {
            "steps": self.oracles.steps,
            "aliased": self.oracles.num_aliased,
            "violations": dict(self.oracles.violations),
            "corruptions": len(self.runner.corruptions),
            "keep_label_mismatches": len(self.oracles.keep_label_mismatches),
            "live_mismatches": len(self.oracles.live_mismatches),
            "pending_alloc_failures": s["hybridserve_mamba_pending_alloc_failures_total"],
            "donations_skipped": dict(s["hybridserve_mamba_donations_skipped_total"]),
            "donations": s["hybridserve_mamba_donations_total"],
            "inplace_writes": s["hybridserve_mamba_inplace_track_writes_total"],
            "inserted": dict(s["hybridserve_mamba_checkpoints_inserted_total"]),
            "evicted": s["hybridserve_mamba_checkpoints_evicted_total"],
            "overlapped_launches": self.engine.num_overlapped_launches,
        }


def distinct_prompts(n: int, length: int, vocab: ToyVocab, seed: int, first_token_base: int = 0) -> list[list[int]]:
    """``n`` prompts whose first tokens all differ (no shared KV path, so no branch points)."""
    import random

    rng = random.Random(seed)
    span = vocab.high - vocab.low
    assert first_token_base + n <= span
    return [
        [vocab.low + first_token_base + i] + [rng.randrange(vocab.low, vocab.high) for _ in range(length - 1)]
        for i in range(n)
    ]
