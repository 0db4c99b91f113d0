"""``cache.store_write_policy``: which checkpoints reach the store while they are hot.

Replica ``a`` answers a prompt and commits what its policy copied; replica ``b`` is then
given the prompt plus the first ``RESUMED`` tokens of ``a``'s answer -- what the ingress
sends when ``a`` dies mid-stream. Under ``write_through`` ``b`` fetches a checkpoint inside
``a``'s answer and continues it exactly; under ``write_back`` nothing was committed (no
eviction, no hit); under ``write_through_selective`` only the prompt's own checkpoints.
"""

from __future__ import annotations

import asyncio

import pytest

from cluster.store.checkpoint_store import CheckpointStore
from cluster.store.client import FetchSettings, LocalStoreBackend, StoreClient
from tests.workers.engine.helpers import make_llm, random_prompts
from workers.sampling.params import SamplingParams
from workers.tiers.write_policy import WritePolicy

MAX_TOKENS, RESUMED, PROMPT = 20, 12, 21
P = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
TIERS = {
    "page_size": 4,
    "mamba_track_interval": 8,
    "host_mamba_slots": 16,
    "host_kv_tokens": 1024,
    "cluster_store_bytes": 1 << 26,
}
SLOW_PREFILL = FetchSettings(bandwidth_bytes_per_s=1e15, prefill_tokens_per_s=1.0, latency_s=0.0, measure=False)


class Direct:
    """``EngineLoop.run`` without the thread."""

    def __init__(self, engine) -> None:
        self.engine = engine

    async def run(self, fn):
        return fn(self.engine)


def replica(model_dir, policy: str):
    llm = make_llm(model_dir, cache={**TIERS, "store_write_policy": policy}, debug={"check_invariants": True})
    llm.engine.raise_on_violation = True
    return llm


def run_and_commit(model_dir, policy: str, store: CheckpointStore):
    a = replica(model_dir, policy)
    prompt = random_prompts(a.engine.vocab_size, [PROMPT], seed=5)[0]
    out = a.generate_ids([prompt], [P])[0]
    asyncio.run(StoreClient(LocalStoreBackend(store), 4, "a").commit_pending(Direct(a.engine)))
    return a, prompt, out.token_ids


@pytest.mark.parametrize("policy", ["write_back", "write_through", "write_through_selective"])
def test_what_each_policy_commits_and_what_a_resume_finds(tiny_qwen_dir, policy):
    store = CheckpointStore(1 << 26)
    a, prompt, answer = run_and_commit(tiny_qwen_dir, policy, store)
    depths = sorted(e.depth for e in store.entries())
    put = a.stats()["hybridserve_tier_bytes_total"].get("store_put", 0)
    print(f"\n[{policy}] store depths {depths}, {put} bytes committed for one request")
    if policy == "write_back":
        assert depths == [] and put == 0
    elif policy == "write_through_selective":
        assert depths and max(depths) <= PROMPT and put > 0
    else:
        assert max(depths) > PROMPT + RESUMED - 8  # a decode-grid checkpoint inside the answer
    b = replica(tiny_qwen_dir, "write_back")
    resumed = prompt + answer[:RESUMED]
    fetched = asyncio.run(
        StoreClient(LocalStoreBackend(store), 4, "b", SLOW_PREFILL).prefetch(Direct(b.engine), resumed)
    )
    rest = b.generate_ids(
        [resumed], [SamplingParams(max_tokens=MAX_TOKENS - RESUMED, temperature=0.0, ignore_eos=True)]
    )
    assert rest[0].token_ids == answer[RESUMED:]  # greedy: the resume continues the answer exactly
    expected = {"write_back": 0, "write_through_selective": 20, "write_through": 32}[policy]
    assert (fetched == "fetched") == (expected > 0)
    assert rest[0].cached_tokens == expected


def test_the_policy_rules():
    with pytest.raises(ValueError, match="unknown store write policy"):
        WritePolicy("write_around", store_on=True)  # type: ignore[arg-type]
    through, selective, back = (
        WritePolicy(n, store_on=True) for n in ("write_through", "write_through_selective", "write_back")
    )
    assert [through.on_publish(p) for p in ("prefill", "decode", "finish")] == [True, True, True]
    assert [selective.on_publish(p) for p in ("prefill", "decode", "finish")] == [True, False, False]
    assert [back.on_publish(p) for p in ("prefill", "decode", "finish")] == [False, False, False]
    assert all(p.on_hit() for p in (through, selective, back))
    off = WritePolicy("write_through", store_on=False)  # no store: nothing to commit, no copies
    assert not off.on_publish("prefill") and not off.on_hit()
    with pytest.raises(ValueError, match="unknown publish phase"):
        through.on_publish("verify")
