"""The host tier end to end on real tiny models.

Every engine here checks the cache invariants after every step (violations raise) -- the
host tree's I1-I9, its labels and pages, and the promotions' ledger entries included --
and every greedy output is compared with a cache-off control. Evictions are forced
directly (``tree.evict_checkpoints``: the same path pool pressure takes) where a test needs
one particular checkpoint on the host and another on the device.
"""

from __future__ import annotations

import pytest
import torch

from tests.workers.engine.helpers import make_llm, random_prompts
from workers.sampling.params import SamplingParams

P = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
HOST = {"host_mamba_slots": 32, "host_kv_tokens": 2048}
# One family per kind of state: GDN + attention (+ MTP), Mamba2 + attention, Mamba2 alone.
TIER_FAMILIES = ["qwen3_next", "granitemoehybrid", "mamba2"]


def tiered_llm(model_dir, strategy="extra_buffer_lazy", cache=None, **extra):
    llm = make_llm(
        model_dir,
        cache={"mamba_strategy": strategy, "mamba_track_interval": 16, **HOST, **(cache or {})},
        debug={"check_invariants": True, **extra.pop("debug", {})},
        **extra,
    )
    llm.engine.raise_on_violation = True
    return llm


@pytest.fixture(scope="module", params=TIER_FAMILIES)
def family_dir(request, tiny_checkpoint):
    return tiny_checkpoint(request.param)


@pytest.fixture(scope="module")
def off(family_dir):
    return make_llm(family_dir, cache={"enable_prefix_cache": False})


def stat(llm, name, label):
    return llm.stats()[name].get(label, 0)


def host_and_device_split(llm, vocab):
    """A system prompt (16 tokens) and a question: the device keeps the checkpoint at the
    system prompt's end (16), the one at the question's end (24) is demoted to the host."""
    system, q1, q2 = random_prompts(vocab, [16, 9, 7], seed=3)
    first = system + q1
    llm.generate_ids([first], [P])
    llm.generate_ids([system + q2], [P])  # a device hit at 16: 16 is now the newer
    tree = llm.engine.cache.tree
    deep = first[: len(first) - 1]
    assert tree.peek(deep).depth == 24 and tree.peek(system + q2[:-1]).depth >= 16
    while tree.peek(deep).depth == 24:  # evict, oldest first, until 24 went down
        assert tree.evict_checkpoints(1).num_checkpoints == 1
    assert llm.engine.cache.host.peek(deep).depth == 24
    scribble_free_pages(llm)
    return system, first


def scribble_free_pages(llm) -> None:
    """Noise into every free device KV page: eviction freed the pages of [16, 24) with their
    KV still in them, and a promotion may get those very pages back (the allocator is LIFO),
    so a copy that skipped the KV would otherwise go unnoticed."""
    engine = llm.engine
    ps, alloc = engine.cache.page_size, engine.page_allocator
    free = [p for p in range(1, alloc.num_usable + 1) if alloc.is_free(p)]
    rows = torch.tensor([p * ps + i for p in free for i in range(ps)])
    gen = torch.Generator().manual_seed(0)
    for tensors in engine.pools.kv.groups.values():
        for t in tensors.values():
            idx = rows.to(t.device)
            t[:, idx] = torch.randn(t[:, idx].shape, generator=gen).to(t.device, t.dtype)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("strategy", ["no_buffer", "extra_buffer", "extra_buffer_lazy"])
def test_promotion_over_a_device_hit(family_dir, off, strategy, overlap):
    """The device holds H(16), the host H(24): a follow-up resumes from 24, bit for bit."""
    page = {"no_buffer": 1}.get(strategy, 4)
    llm = tiered_llm(family_dir, strategy, cache={"page_size": page}, scheduler={"overlap": overlap})
    vocab = llm.engine.vocab_size
    if strategy == "no_buffer":  # no prefill checkpoints: publish them by finishing
        system, q1 = random_prompts(vocab, [16, 9], seed=3)
        first = system + q1
        out = llm.generate_ids([first], [P])[0]
        tree = llm.engine.cache.tree
        follow = first + out.token_ids + random_prompts(vocab, [3], seed=4)[0]
        depth = tree.peek(follow[:-1]).depth  # the live state at finish: all but the last token
        assert depth == len(first) + len(out.token_ids) - 1
        tree.evict_checkpoints(tree.num_evictable_checkpoints)
    else:
        system, first = host_and_device_split(llm, vocab)
        depth = 24
        follow = first + random_prompts(vocab, [5], seed=4)[0]
    got = llm.generate_ids([follow], [P])[0]
    assert got.token_ids == off.generate_ids([follow], [P])[0].token_ids
    assert got.cached_tokens == depth
    assert stat(llm, "hybridserve_tier_promotions_total", "promoted") == 1
    assert stat(llm, "hybridserve_cache_hits_total", "host") == 1
    if strategy != "no_buffer":  # the promoted checkpoint is on the device again
        assert llm.engine.cache.tree.peek(follow[:-1]).depth >= 24


@pytest.mark.parametrize("family", ["kimi_linear", "minimax", "glm5_next"])
def test_promotion_copies_every_kind_of_state(tiny_checkpoint, family):
    """Kinds no model above has: KDA and MLA's latent pool (Kimi-Linear), lightning
    attention's conv-less state (MiniMax), the indexer's rows (GLM-5.3-Flash). The host pools
    mirror whatever the device pools hold, so a promotion resumes these exactly too: the state
    oracle checks the promoted state, the logprobs (against cache-off's, to float noise) the
    promoted KV / latents / indexer rows."""
    model_dir = tiny_checkpoint(family)
    off = make_llm(model_dir, cache={"enable_prefix_cache": False})
    llm = tiered_llm(model_dir, scheduler={"overlap": True}, debug={"state_oracle_sample": 1.0})
    system, first = host_and_device_split(llm, llm.engine.vocab_size)
    follow = first + random_prompts(llm.engine.vocab_size, [5], seed=4)[0]
    scored = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    got, want = llm.generate_ids([follow], [scored])[0], off.generate_ids([follow], [scored])[0]
    assert got.token_ids == want.token_ids
    assert [lp.logprob for lp in got.logprobs] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-4)
    assert got.cached_tokens == 24 and stat(llm, "hybridserve_tier_promotions_total", "promoted") == 1
    s = llm.stats()
    assert s["hybridserve_state_oracle_checks_total"] > 0
    assert s["hybridserve_state_oracle_mismatches_total"] == 0


def test_promotion_with_mtp_and_the_state_oracle(tiny_qwen_dir):
    """MTP drafts, overlap, and every published checkpoint recomputed by a fresh prefill:
    the promoted ones were copied host -> device, so this checks the copies' data."""
    off = make_llm(tiny_qwen_dir, cache={"enable_prefix_cache": False})
    llm = tiered_llm(tiny_qwen_dir, spec={"method": "mtp", "num_draft_tokens": 2}, debug={"state_oracle_sample": 1.0})
    system, first = host_and_device_split(llm, llm.engine.vocab_size)
    follows = [first + q for q in random_prompts(llm.engine.vocab_size, [5, 8, 11], seed=8)]
    got = llm.generate_ids(follows, [P] * 3)
    assert [o.token_ids for o in got] == [o.token_ids for o in off.generate_ids(follows, [P] * 3)]
    assert [o.cached_tokens for o in got] == [24, 24, 24]
    s = llm.stats()
    assert s["hybridserve_state_oracle_checks_total"] > 0
    assert s["hybridserve_state_oracle_mismatches_total"] == 0


def test_a_failed_promotion_recomputes_from_the_device_hit(tiny_qwen_dir):
    off = make_llm(tiny_qwen_dir, cache={"enable_prefix_cache": False})
    llm = tiered_llm(tiny_qwen_dir)
    system, first = host_and_device_split(llm, llm.engine.vocab_size)
    llm.engine.cache.host.fail_prob = 1.0  # every copy from now on breaks half way
    follow = first + [7, 8, 9]
    got = llm.generate_ids([follow], [P])[0]
    assert got.token_ids == off.generate_ids([follow], [P])[0].token_ids
    assert got.cached_tokens == 16  # the device hit, not the host's 24
    assert stat(llm, "hybridserve_tier_promotions_total", "failed") == 1
    assert stat(llm, "hybridserve_cache_hits_total", "device") >= 1


def test_failed_demotions_and_a_full_host_tier_drop_never_block(tiny_qwen_dir):
    """One host slot and broken copies: evictions still free device slots at once. The
    prompts share a system prompt: once its checkpoint fills the single host slot, a
    deeper one on its path cannot evict it (the demotion reuses its pages): host full."""
    off = make_llm(tiny_qwen_dir, cache={"enable_prefix_cache": False})
    for host_slots, fail in ((1, 0.0), (32, 1.0)):
        llm = tiered_llm(
            tiny_qwen_dir,
            cache={"max_mamba_slots": 6, "host_mamba_slots": host_slots},
            debug={"fail_transfer_prob": fail},
            scheduler={"max_running_requests": 2},
        )
        vocab = llm.engine.vocab_size
        system = random_prompts(vocab, [12], seed=10)[0]
        prompts = [system + q for q in random_prompts(vocab, [1 + 3 * i for i in range(8)], seed=11)]
        got = llm.generate_ids(prompts, [P] * 8) + llm.generate_ids(prompts, [P] * 8)
        want = off.generate_ids(prompts, [P] * 8)
        assert [o.token_ids for o in got] == [o.token_ids for o in want] * 2
        demoted = llm.stats()["hybridserve_tier_demotions_total"]
        assert demoted.get("failed" if fail else "host_full", 0) > 0, demoted
        num_host = llm.engine.cache.host.num_checkpoints
        assert num_host <= host_slots and (not fail or num_host == 0)


def test_multi_turn_under_slot_pressure_hits_every_turn_two(tiny_qwen_dir):
    """Slot pressure: 24 slots, 4 running, 20 conversations over 5 system prompts. On the
    device alone some turn-2 prompts find their checkpoint evicted; with a host tier of four
    times the device's slots all 20 resume from (at least) their turn-1 prompt."""
    off = make_llm(tiny_qwen_dir, cache={"enable_prefix_cache": False})
    counts = {}
    for host in (False, True):
        cache = {"max_mamba_slots": 24, "host_mamba_slots": 96 if host else 0, "host_kv_tokens": 4096 if host else 0}
        llm = tiered_llm(tiny_qwen_dir, cache=cache, scheduler={"max_running_requests": 4})
        vocab = llm.engine.vocab_size
        systems = random_prompts(vocab, [24] * 5, seed=21)
        turn1 = [
            systems[i % 5] + q for i, q in enumerate(random_prompts(vocab, [6 + i % 7 for i in range(20)], seed=22))
        ]
        outs1 = llm.generate_ids(turn1, [P] * 20)
        news = random_prompts(vocab, [4] * 20, seed=23)
        turn2 = [p + o.token_ids + q for p, o, q in zip(turn1, outs1, news)]
        outs2 = llm.generate_ids(turn2, [P] * 20)
        assert [o.token_ids for o in outs2] == [o.token_ids for o in off.generate_ids(turn2, [P] * 20)]
        counts[host] = sum(o.cached_tokens >= (len(p) - 1) // 4 * 4 for p, o in zip(turn1, outs2))
    assert counts[True] == 20 and counts[False] < 20, counts


def test_flush_empties_the_host_tier_too(tiny_qwen_dir):
    llm = tiered_llm(tiny_qwen_dir)
    host_and_device_split(llm, llm.engine.vocab_size)
    assert llm.engine.cache.host.num_checkpoints > 0
    llm.flush_cache()
    assert llm.engine.cache.host.num_checkpoints == 0 and llm.engine.cache.tree.num_checkpoints == 0
    assert llm.engine.check_invariants() == []


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"cache": {"host_mamba_slots": 4}}, "must both be 0"),
        (
            {"cache": {"host_mamba_slots": 4, "host_kv_tokens": 64, "enable_prefix_cache": False}},
            "needs cache.enable_prefix_cache",
        ),
        ({"cache": {"cluster_store_bytes": 1 << 20}}, "needs the host tier"),
        ({"cache": {"host_mamba_slots": 4, "host_kv_tokens": 2}}, "one page"),
    ],
)
def test_bad_tier_configs_are_refused(tiny_qwen_dir, overrides, message):
    with pytest.raises(ValueError, match=message):
        make_llm(tiny_qwen_dir, **overrides)


def test_an_asynchronous_promotion_holds_the_request_until_the_copy_is_done(tiny_qwen_dir):
    """The GPU path's timing on a CPU: copies queued on the forward thread behind the batch
    in flight (as on a copy stream), so the request waits a step with its slots held."""
    off = make_llm(tiny_qwen_dir, cache={"enable_prefix_cache": False})
    llm = tiered_llm(tiny_qwen_dir, scheduler={"overlap": True})
    engine = llm.engine
    system, first = host_and_device_split(llm, engine.vocab_size)
    engine.cache.host.storage.submit = engine.runner.submit
    busy, follow = random_prompts(engine.vocab_size, [40], seed=30)[0], first + [5, 6, 7]
    llm.add_request("busy", busy, P)
    llm.step()  # a batch in flight on the forward thread
    llm.add_request("follow", follow, P)
    seen_pending = False
    outs = {}
    while engine.has_unfinished():
        for out in llm.step():
            outs[out.request_id] = out
        req = engine.requests.get("follow")
        seen_pending |= req is not None and req.cache.promotion is not None
    assert seen_pending
    assert outs["follow"].token_ids == off.generate_ids([follow], [P])[0].token_ids
    assert outs["follow"].cached_tokens == 24
    assert outs["busy"].token_ids == off.generate_ids([busy], [P])[0].token_ids
