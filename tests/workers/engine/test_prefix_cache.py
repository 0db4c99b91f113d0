"""Prefix caching of recurrent state, end to end on real tiny models.

Every run checks the cache invariants after every step (violations raise), compares
greedy tokens with a cache-off control, and checks ``cached_tokens`` against what the
tree held when the request arrived.
"""

from __future__ import annotations

import random

import pytest

from configs.schema import CacheConfig
from tests.workers.engine.helpers import make_llm, random_prompts
from workers.cache import CheckpointInserted
from workers.sampling.params import SamplingParams

STRATEGIES = ["no_buffer", "extra_buffer", "extra_buffer_lazy"]
DEFAULT_STRATEGY = CacheConfig().mamba_strategy  # runs for every family; the others on CORE_FAMILIES
P = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def cached_llm(model_dir, strategy, page_size=4, interval=8, **extra):
    cache = {
        "mamba_strategy": strategy,
        "page_size": page_size,
        "mamba_track_interval": interval,
        **extra.pop("cache", {}),
    }
    llm = make_llm(model_dir, cache=cache, debug={"check_invariants": True}, **extra)
    llm.engine.raise_on_violation = True
    return llm


def shared_prefix_workload(vocab: int, num_systems=8, num_questions=8, seed=0) -> list[list[int]]:
    rng = random.Random(seed)
    systems = random_prompts(vocab, [rng.randrange(9, 30) for _ in range(num_systems)], seed=seed)
    return [
        s + random_prompts(vocab, [rng.randrange(2, 12)], seed=1000 * i + j)[0]
        for i, s in enumerate(systems)
        for j in range(num_questions)
    ]


def expected_hit(llm, prompt: list[int]) -> int:
    return llm.engine.cache.tree.peek(prompt[: len(prompt) - 1]).depth


def run_one_by_one(llm, prompts):
    """Generate sequentially, returning (outputs, depth the tree offered each prompt)."""
    outs, offered = [], []
    for p in prompts:
        offered.append(expected_hit(llm, p))
        outs.append(llm.generate_ids([p], [P])[0])
    return outs, offered


def two_turns(llm, new_lens: list[int], seed: int):
    """Conversations of growing length: turn 1, its outputs, turn 2 = turn 1 + its output
    + new text of ``new_lens``."""
    vocab, n = llm.engine.vocab_size, len(new_lens)
    turn1 = random_prompts(vocab, [9 + 3 * i for i in range(n)], seed=seed)
    outs1 = llm.generate_ids(turn1, [P] * n)
    news = random_prompts(vocab, new_lens, seed=seed + 1)
    return turn1, outs1, [p + o.token_ids + q for p, o, q in zip(turn1, outs1, news)]


@pytest.fixture(scope="module")
def control(tiny_model_dir):
    off = make_llm(tiny_model_dir, cache={"enable_prefix_cache": False})
    # seed 1: under seed 0 jamba's prompt 56 meets an exact tie of two experts' router
    # probabilities, which the batched pass's GEMM rounding can break either way: a tie,
    # not a cache fault
    prompts = shared_prefix_workload(off.engine.vocab_size, seed=1)
    return prompts, [o.token_ids for o in off.generate_ids(prompts, [P] * len(prompts))]


@pytest.mark.core_families(all_families_for={"strategy": DEFAULT_STRATEGY})
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_shared_prefix_differential(tiny_model_dir, control, strategy):
    prompts, expected = control
    # 40 usable slots and 600 KV tokens for 64 prompts: evictions are forced.
    llm = cached_llm(tiny_model_dir, strategy, interval=64, cache={"max_mamba_slots": 40, "max_kv_tokens": 600})
    llm.engine.record_cache_events()
    first = llm.generate_ids(prompts, [P] * len(prompts))
    assert [o.token_ids for o in first] == expected
    second, offered = run_one_by_one(llm, prompts)
    assert [o.token_ids for o in second] == expected
    assert [o.cached_tokens for o in second] == offered
    stats = llm.stats()
    assert stats["hybridserve_mamba_checkpoints_evicted_total"] > 0 or strategy == "no_buffer"
    inserted = {e.token_ids for e in llm.engine.drain_cache_events() if isinstance(e, CheckpointInserted)}
    for p, o in zip(prompts, second):
        # A hit is exactly the depth of a checkpoint the first pass published on its path.
        assert o.cached_tokens == 0 or tuple(p[: o.cached_tokens]) in inserted, (len(p), o.cached_tokens)
    if strategy != "no_buffer":
        # Half the prompts are served, some from their own prefill target (the deepest page
        # boundary below their end), not merely from a shorter shared system prompt (under
        # this pressure most own targets are evicted before the prompt comes round again).
        own = [o.cached_tokens == ((len(p) - 1) // 4) * 4 for p, o in zip(prompts, second)]
        assert sum(o > 0 for o in offered) >= len(prompts) // 2
        assert sum(own) >= len(prompts) // 16, sum(own)
    assert stats["hybridserve_invariant_violations_total"] == {}


@pytest.mark.parametrize("strategy", ["extra_buffer", "extra_buffer_lazy"])
def test_repeat_hits_exact_prefill_target(tiny_model_dir, strategy):
    llm = cached_llm(tiny_model_dir, strategy)
    prompts = random_prompts(llm.engine.vocab_size, [5, 8, 9, 16, 17, 23])
    first = llm.generate_ids(prompts, [P] * len(prompts))
    second = llm.generate_ids(prompts, [P] * len(prompts))
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    assert [o.cached_tokens for o in first] == [0] * len(prompts)
    assert [o.cached_tokens for o in second] == [((len(p) - 1) // 4) * 4 for p in prompts]


@pytest.mark.core_families(all_families_for={"strategy": DEFAULT_STRATEGY})
@pytest.mark.parametrize("pressure", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_multi_turn_reuses_previous_turn(tiny_model_dir, strategy, pressure):
    """16 conversations; turn 2 = turn-1 prompt + turn-1 output + new text. Turn 2 resumes
    from the deepest checkpoint turn 1 left (at least its prompt's) when the pool is large
    enough to keep them all, and from exactly what survived when it is not."""
    page = 1 if strategy == "no_buffer" else 4
    llm = cached_llm(tiny_model_dir, strategy, page_size=page, cache={"max_mamba_slots": 24 if pressure else 160})
    off = make_llm(tiny_model_dir, cache={"enable_prefix_cache": False})
    turn1, outs1, turn2 = two_turns(llm, [3 + i % 5 for i in range(16)], seed=5)
    outs2, offered = run_one_by_one(llm, turn2)
    assert [o.token_ids for o in outs2] == [o.token_ids for o in off.generate_ids(turn2, [P] * 16)]
    assert [o.cached_tokens for o in outs2] == offered
    reused = [o.cached_tokens >= ((len(p) - 1) // page) * page > 0 for p, o in zip(turn1, outs2)]
    assert all(reused) if not pressure else llm.stats()["hybridserve_mamba_checkpoints_evicted_total"] > 0
    for p, o1, o2 in zip(turn1, outs1, outs2):
        assert o2.cached_tokens <= len(p) + len(o1.token_ids)


def check_resumes_past_the_answer(model, strategy, **extra):
    llm = cached_llm(model, strategy, interval=256, cache={"max_mamba_slots": 160}, **extra)
    off = make_llm(model, cache={"enable_prefix_cache": False})
    turn1, _, turn2 = two_turns(llm, [3 + i % 4 for i in range(8)], seed=15)
    outs2 = llm.generate_ids(turn2, [P] * 8)
    assert [o.token_ids for o in outs2] == [o.token_ids for o in off.generate_ids(turn2, [P] * 8)]
    past = [((len(p) + P.max_tokens - 1) // 4) * 4 for p in turn1]
    assert [o.cached_tokens for o in outs2] == past, [len(p) for p in turn1]
    assert llm.stats()["hybridserve_invariant_violations_total"] == {}


@pytest.mark.parametrize("strategy", ["extra_buffer", "extra_buffer_lazy"])
def test_next_turn_resumes_past_the_answer(tiny_model_dir, strategy):
    """The end-of-output checkpoint (``CheckpointTracker.output_target``): a turn-2 prompt
    (turn 1 + its 10-token answer + new text) resumes at the last page boundary the answer
    reached, not at turn 1's prompt end. The track grid (256) is beyond every context
    here, so no grid point can do it instead."""
    check_resumes_past_the_answer(tiny_model_dir, strategy)


def test_next_turn_resumes_past_the_answer_with_mtp(tiny_mtp_model_dir):
    """The same when a verify (MTP, 3 drafts) crosses the end-of-output target."""
    check_resumes_past_the_answer(
        tiny_mtp_model_dir, "extra_buffer_lazy", spec={"method": "mtp", "num_draft_tokens": 3}
    )


def test_branch_point_becomes_reusable(tiny_model_dir):
    llm = cached_llm(tiny_model_dir, "extra_buffer_lazy")
    vocab = llm.engine.vocab_size
    system = random_prompts(vocab, [14], seed=9)[0]  # 3 whole pages + 2 tokens
    a, b, c = (system + q for q in random_prompts(vocab, [7, 5, 9], seed=10))
    assert llm.generate_ids([a], [P])[0].cached_tokens == 0
    # b shares 14 tokens with a: no checkpoint there yet, but the KV path does match.
    assert llm.generate_ids([b], [P])[0].cached_tokens == 0
    assert llm.generate_ids([c], [P])[0].cached_tokens == 12  # the branch point of b


@pytest.mark.parametrize("strategy", ["extra_buffer", "extra_buffer_lazy"])
def test_grid_point_below_the_prompt_end_serves_the_next_question(tiny_model_dir, strategy):
    """The first prompt's prefill also checkpoints the deepest grid point below its end (16
    here: grid 8, last reachable page 20), so the SECOND question on a 16-token system prompt
    already hits it -- without it, only a third would (after the second wrote the branch)."""
    llm = cached_llm(tiny_model_dir, strategy)
    off = make_llm(tiny_model_dir, cache={"enable_prefix_cache": False})
    vocab = llm.engine.vocab_size
    system = random_prompts(vocab, [16], seed=11)[0]
    a, b = (system + q for q in random_prompts(vocab, [7, 6], seed=12))
    outs = [llm.generate_ids([p], [P])[0] for p in (a, b)]
    assert [o.cached_tokens for o in outs] == [0, 16]
    assert [o.token_ids for o in outs] == [o.token_ids for o in off.generate_ids([a, b], [P, P])]


def prefill_chunks(llm) -> dict[str, list[tuple[int, int]]]:
    """Record every prefill chunk (start, end) the scheduler launches, per request id."""
    chunks: dict[str, list[tuple[int, int]]] = {}
    scheduler = llm.engine.scheduler
    launch = scheduler.on_launch

    def on_launch(batch):
        for seq in batch.seqs:
            if seq.start < seq.request.num_prompt_tokens:
                chunks.setdefault(seq.request.request_id, []).append((seq.start, seq.end))
        launch(batch)

    scheduler.on_launch = on_launch
    return chunks


@pytest.mark.parametrize("strategy", ["extra_buffer", "extra_buffer_lazy"])
def test_resumed_prompt_prefills_in_one_chunk(tiny_model_dir, strategy):
    """A cold prompt is cut at its grid point (16: grid 8, last page 20) so that a system
    prompt gets a checkpoint; the next turn, resuming from the answer's end (32), skips the
    grid point (40) below its last page (44): one chunk, one step to its first token
    (cut at 40, it took two), the same tokens as cache-off."""
    llm = cached_llm(tiny_model_dir, strategy)
    off = make_llm(tiny_model_dir, cache={"enable_prefix_cache": False})
    vocab = llm.engine.vocab_size
    system, question, new = random_prompts(vocab, [16, 7, 13], seed=21)
    turn1 = system + question
    out1 = llm.generate_ids([turn1], [P])[0]
    turn2 = turn1 + out1.token_ids + new
    chunks = prefill_chunks(llm)
    out2 = llm.generate_ids([turn2], [P])[0]
    assert out2.cached_tokens == 32
    assert list(chunks.values()) == [[(32, 46)]]
    assert [out1.token_ids, out2.token_ids] == [o.token_ids for o in off.generate_ids([turn1, turn2], [P, P])]
    fresh = cached_llm(tiny_model_dir, strategy)
    cold = prefill_chunks(fresh)
    fresh.generate_ids([turn1], [P])
    assert list(cold.values()) == [[(0, 16), (16, 23)]]


@pytest.mark.parametrize("strategy", ["extra_buffer", "extra_buffer_lazy"])
def test_one_token_request_prefills_in_one_chunk_and_publishes_its_prompt_end(tiny_model_dir, strategy):
    """``max_tokens`` 1 on a page-aligned prompt (12 tokens, page 4, grid 256): its
    prompt's end is where its state stops, published from the live slot at the finish; no
    snapshot is planned for it, so the prompt is not cut at its last reachable page (8):
    one chunk. The next turn resumes at 12, an identical prompt at 8; tokens as cache-off."""
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm = cached_llm(tiny_model_dir, strategy, interval=256)
    off = make_llm(tiny_model_dir, cache={"enable_prefix_cache": False})
    prompt, more = random_prompts(llm.engine.vocab_size, [12, 6], seed=23)
    chunks = prefill_chunks(llm)
    out1 = llm.generate_ids([prompt], [one])[0]
    assert list(chunks.values()) == [[(0, 12)]]
    turn2 = prompt + out1.token_ids + more
    again, out2 = llm.generate_ids([prompt], [one])[0], llm.generate_ids([turn2], [P])[0]
    assert (again.cached_tokens, out2.cached_tokens) == (8, 12)
    expected = off.generate_ids([prompt, prompt, turn2], [one, one, P])
    assert [o.token_ids for o in (out1, again, out2)] == [o.token_ids for o in expected]
    assert llm.stats()["hybridserve_invariant_violations_total"] == {}


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("chunk", [5, 13, 64])
def test_boundary_sweep(tiny_qwen_dir, page_size, chunk):
    interval = 32
    grid = 32
    lengths = [grid + d for d in (-3, -1, 1, 3)] + [2 * grid + d for d in (-3, -1, 1, 3)]
    llm = cached_llm(
        tiny_qwen_dir,
        "extra_buffer_lazy",
        page_size=page_size,
        interval=interval,
        scheduler={"chunked_prefill_size": chunk, "max_batch_tokens": 64},
    )
    off = make_llm(tiny_qwen_dir, cache={"enable_prefix_cache": False})
    prompts = random_prompts(llm.engine.vocab_size, lengths, seed=page_size + chunk)
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)] * len(prompts)
    expected = [o.token_ids for o in off.generate_ids(prompts, params)]
    assert [o.token_ids for o in llm.generate_ids(prompts, params)] == expected
    second = llm.generate_ids(prompts, params)
    assert [o.token_ids for o in second] == expected
    assert [o.cached_tokens for o in second] == [((n - 1) // page_size) * page_size for n in lengths]


@pytest.mark.core_families(all_families_for={"strategy": DEFAULT_STRATEGY})
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_exhausted_pool_serves_everything(tiny_model_dir, strategy):
    # Exactly one slot per running request: no room for any checkpoint.
    llm = cached_llm(tiny_model_dir, strategy, cache={"max_mamba_slots": 4}, scheduler={"max_running_requests": 4})
    off = make_llm(tiny_model_dir, cache={"enable_prefix_cache": False})
    prompts = shared_prefix_workload(llm.engine.vocab_size, num_systems=3, num_questions=4)
    expected = [o.token_ids for o in off.generate_ids(prompts, [P] * len(prompts))]
    for _ in range(2):
        assert [o.token_ids for o in llm.generate_ids(prompts, [P] * len(prompts))] == expected
    counts = llm.engine.pool_counts()
    assert counts["mamba_slots_free"] + counts["mamba_slots_cached"] == counts["mamba_slots_usable"] == 4


def test_cache_counters_and_flush(tiny_qwen_dir):
    llm = cached_llm(tiny_qwen_dir, "extra_buffer_lazy")
    llm.engine.record_cache_events()
    prompts = random_prompts(llm.engine.vocab_size, [10, 18])
    llm.generate_ids(prompts, [P] * 2)
    llm.generate_ids(prompts, [P] * 2)
    stats = llm.stats()
    assert stats["hybridserve_prefix_query_tokens_total"] == 2 * sum(map(len, prompts))
    assert stats["hybridserve_prefix_hit_tokens_total"] == 8 + 16
    assert stats["hybridserve_mamba_donations_total"] > 0
    assert stats["hybridserve_mamba_checkpoints_inserted_total"]["prefill"] >= 2
    events = llm.engine.drain_cache_events()
    assert events and all(e.depth % 4 == 0 for e in events)
    llm.flush_cache()
    assert llm.generate_ids(prompts, [P] * 2)[0].cached_tokens == 0


def test_an_engine_nobody_drains_keeps_no_cache_events(tiny_qwen_dir):
    """An offline LLM publishes to nobody: its events would grow with every checkpoint it
    ever inserted or evicted (the soak's replicas drain theirs, an in-process LLM did not)."""
    llm = cached_llm(tiny_qwen_dir, "extra_buffer_lazy", cache={"max_mamba_slots": 8})
    prompts = random_prompts(llm.engine.vocab_size, [20, 28, 36, 44])
    for _ in range(3):
        llm.generate_ids(prompts, [P] * len(prompts))
    assert llm.stats()["hybridserve_mamba_checkpoints_inserted_total"]["prefill"] > 0
    assert llm.engine.cache.events is None and llm.engine.drain_cache_events() == []
    llm.engine.record_cache_events()
    llm.flush_cache()
    assert llm.engine.drain_cache_events()  # recording: the flush's evictions
