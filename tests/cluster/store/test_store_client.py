"""Two engines in one process sharing a store (``LocalStoreBackend``): one demotes and
commits, the other fetches, validates, promotes -- and answers exactly as a cache-off
engine does, with the fetched tokens in ``cached_tokens``. The cost model's other answer,
lost objects and invalid payloads are each a counted outcome, never a failed request."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from cluster.store.checkpoint_store import CheckpointStore
from cluster.store.client import FetchSettings, LocalStoreBackend, StoreClient
from tests.workers.engine.helpers import make_llm, random_prompts
from workers.sampling.params import SamplingParams

P = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
TIERS = {"page_size": 4, "host_mamba_slots": 16, "host_kv_tokens": 1024, "cluster_store_bytes": 1 << 26}


class Direct:
    """``EngineLoop.run`` without the thread: the engine is driven from this test."""

    def __init__(self, engine) -> None:
        self.engine = engine

    async def run(self, fn):
        return fn(self.engine)


def replica(model_dir, cache=None, debug=None, **extra):
    llm = make_llm(
        model_dir, cache={**TIERS, **(cache or {})}, debug={"check_invariants": True, **(debug or {})}, **extra
    )
    llm.engine.raise_on_violation = True
    return llm


def committed_prompt(a, client, vocab):
    """Replica ``a`` runs a prompt, demotes its checkpoints and commits them to the store."""
    prompt = random_prompts(vocab, [21], seed=5)[0]
    a.generate_ids([prompt], [P])
    tree = a.engine.cache.tree
    tree.evict_checkpoints(tree.num_evictable_checkpoints)  # -> host tier -> commit list
    events = asyncio.run(client.commit_pending(Direct(a.engine)))
    assert {e.tier for e in events} == {"store"} and events
    return prompt


@pytest.fixture
def pair(tiny_qwen_dir):
    store = CheckpointStore(1 << 26)
    backend = LocalStoreBackend(store)
    return store, replica(tiny_qwen_dir), replica(tiny_qwen_dir), backend


def test_a_checkpoint_committed_by_one_replica_is_fetched_by_another(tiny_qwen_dir, pair):
    store, a, b, backend = pair
    vocab = a.engine.vocab_size
    prompt = committed_prompt(a, StoreClient(backend, 4, "a"), vocab)
    assert store.num_objects >= 1
    assert a.stats()["hybridserve_store_commits_total"]["committed"] == store.num_objects
    follow = prompt + random_prompts(vocab, [5], seed=6)[0]
    fetcher = StoreClient(backend, 4, "b", FetchSettings(prefill_tokens_per_s=1.0))  # recompute is slow
    assert asyncio.run(fetcher.prefetch(Direct(b.engine), follow)) == "fetched"
    out = b.generate_ids([follow], [P])[0]
    off = make_llm(tiny_qwen_dir, cache={"enable_prefix_cache": False})
    assert out.token_ids == off.generate_ids([follow], [P])[0].token_ids
    assert out.cached_tokens == 20
    s = b.stats()
    assert s["hybridserve_cache_hits_total"] == {"store": 1}
    assert s["hybridserve_store_fetches_total"] == {"fetched": 1}
    assert s["hybridserve_tier_bytes_total"]["store_get"] > 0
    # Local now: a second prefetch does not go to the store.
    assert asyncio.run(fetcher.prefetch(Direct(b.engine), follow)) == "none"


@pytest.mark.parametrize("measure", [True, False])
def test_a_modelled_cost_model_keeps_its_throughputs(pair, measure):
    """``FetchSettings.measure=False`` (the in-process benchmark): the fetch and the engine's
    forward steps leave the throughputs at the configured values, so a fetch decision does
    not depend on this machine's timings; measured, both move."""
    store, a, b, backend = pair
    vocab = a.engine.vocab_size
    prompt = committed_prompt(a, StoreClient(backend, 4, "a"), vocab)
    settings = FetchSettings(bandwidth_bytes_per_s=1e15, prefill_tokens_per_s=1.0, latency_s=0.0, measure=measure)
    client = StoreClient(backend, 4, "b", settings)
    b.generate_ids([random_prompts(vocab, [30], seed=8)[0]], [P])  # forward steps to observe
    assert asyncio.run(client.prefetch(Direct(b.engine), prompt + [7])) == "fetched"
    b.generate_ids([random_prompts(vocab, [30], seed=9)[0]], [P])
    asyncio.run(client.prefetch(Direct(b.engine), random_prompts(vocab, [30], seed=10)[0]))
    moved = (client.bandwidth.value != 1e15, client.prefill.value != 1.0)
    assert moved == ((True, True) if measure else (False, False)), (client.bandwidth.value, client.prefill.value)


def test_the_cost_model_can_choose_to_recompute(pair):
    store, a, b, backend = pair
    prompt = committed_prompt(a, StoreClient(backend, 4, "a"), a.engine.vocab_size)
    fast = StoreClient(backend, 4, "b", FetchSettings(prefill_tokens_per_s=1e12))  # prefill is free
    assert asyncio.run(fast.prefetch(Direct(b.engine), prompt + [5])) == "recomputed"
    assert b.generate_ids([prompt + [5]], [P])[0].cached_tokens == 0


def test_lost_and_invalid_objects_are_recomputed(pair):
    store, a, b, backend = pair
    prompt = committed_prompt(a, StoreClient(backend, 4, "a"), a.engine.vocab_size)
    slow = FetchSettings(prefill_tokens_per_s=1.0)
    on_path = [e for e in store.entries() if tuple(prompt[: e.depth]) == e.token_ids]  # not its answer's
    deepest = max(on_path, key=lambda e: e.depth)
    store._entries[deepest.key] = replace(deepest, ref=replace(deepest.ref, fingerprint="another model"))
    assert asyncio.run(StoreClient(backend, 4, "b", slow).prefetch(Direct(b.engine), prompt + [5])) == "invalid"
    store._entries[deepest.key] = replace(deepest, ref=None)  # its node died
    assert asyncio.run(StoreClient(backend, 4, "b", slow).prefetch(Direct(b.engine), prompt + [5])) == "lost"
    assert deepest.key not in store
    assert b.stats()["hybridserve_store_fetches_total"] == {"invalid": 1, "lost": 1}
    out = b.generate_ids([prompt + [5]], [P])[0]
    assert out.cached_tokens == 0 and b.engine.check_invariants() == []


@pytest.mark.parametrize("strategy", ["no_buffer", "extra_buffer", "extra_buffer_lazy"])
def test_fetches_answer_as_cache_off_for_every_strategy_with_mtp_and_overlap(tiny_qwen_dir, strategy):
    """The store's first use: a turn-2 prompt whose checkpoints another replica
    committed is fetched, validated and promoted, with MTP drafts and overlap on, under each
    Mamba strategy; the answers equal cache-off's, every promoted checkpoint passes the state
    oracle (a fresh prefill of its tokens), and ``cached_tokens`` is the deepest entry's depth."""
    page = 1 if strategy == "no_buffer" else 4  # no_buffer: checkpoints at finish, unaligned
    extra = {
        "cache": {"page_size": page, "mamba_strategy": strategy, "mamba_track_interval": 8},
        "spec": {"method": "mtp", "num_draft_tokens": 2},
        "scheduler": {"overlap": True},
    }
    a = replica(tiny_qwen_dir, **extra)
    b = replica(tiny_qwen_dir, debug={"state_oracle_sample": 1.0}, **extra)
    store = CheckpointStore(1 << 26)
    backend = LocalStoreBackend(store)
    vocab = a.engine.vocab_size
    prompt = random_prompts(vocab, [21], seed=5)[0]
    out = a.generate_ids([prompt], [P])[0]
    tree = a.engine.cache.tree
    tree.evict_checkpoints(tree.num_evictable_checkpoints)
    assert asyncio.run(StoreClient(backend, page, "a").commit_pending(Direct(a.engine)))
    follows = [prompt + out.token_ids + q for q in random_prompts(vocab, [3, 6], seed=7)]
    usable = [
        e.depth for e in store.entries() if e.depth < len(follows[0]) and tuple(follows[0][: e.depth]) == e.token_ids
    ]
    assert usable, [e.depth for e in store.entries()]
    fetcher = StoreClient(backend, page, "b", FetchSettings(prefill_tokens_per_s=1.0))
    assert asyncio.run(fetcher.prefetch(Direct(b.engine), follows[0])) == "fetched"
    got = b.generate_ids(follows, [P] * 2)
    off = make_llm(tiny_qwen_dir, cache={"enable_prefix_cache": False})
    assert [o.token_ids for o in got] == [o.token_ids for o in off.generate_ids(follows, [P] * 2)]
    assert got[0].cached_tokens == max(usable) and got[1].cached_tokens >= max(usable)
    s = b.stats()
    assert s["hybridserve_cache_hits_total"].get("store", 0) >= 1
    assert s["hybridserve_state_oracle_checks_total"] > 0
    assert s["hybridserve_state_oracle_mismatches_total"] == 0
