"""The scheduler alone: budgets, chunking, admission and preemption, exact counts."""

from __future__ import annotations

from configs.schema import CacheConfig, DebugConfig, SchedulerConfig
from workers.cache.manager import CacheManager
from workers.request import Request, RequestStatus
from workers.sampling.params import SamplingParams
from workers.scheduler import Scheduler, pages_needed
from workers.stats import EngineStats


def make(num_pages=64, num_slots=8, page_size=4, **cfg):
    config = SchedulerConfig(**{"max_batch_tokens": 64, "chunked_prefill_size": 16, **cfg})
    cache = CacheManager(
        CacheConfig(page_size=page_size, enable_prefix_cache=False), DebugConfig(), num_pages, num_slots, EngineStats()
    )
    return Scheduler(config, cache, max_model_len=1024), cache.pages, cache.ledger


def req(rid, n, max_tokens=8):
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens))


def apply(batch, sample_token=7):
    """Pretend the forward ran: advance computed tokens, append a token where sampled."""
    for s in batch.seqs:
        s.request.num_computed_tokens = s.end
        if s.samples:
            s.request.output_token_ids.append(sample_token)


def check_pages(sched):
    for r in sched.running:
        assert len(r.page_ids) >= pages_needed(r.num_computed_tokens, sched.page_size)
        assert r.mamba_slot is not None


def test_chunked_prefill_then_decode():
    sched, _, _ = make()
    r = req("a", 40)
    sched.add(r)
    sizes = []
    while r.num_output_tokens < 3:
        b = sched.schedule()
        sizes.append([s.num_new_tokens for s in b.seqs])
        apply(b)
        check_pages(sched)
    assert sizes == [[16], [16], [8], [1], [1]]


def test_budget_mixes_prefill_and_decode():
    sched, _, _ = make(max_batch_tokens=20)
    a, b = req("a", 4), req("b", 30)
    sched.add(a)
    apply(sched.schedule())  # a prefilled, a has 1 output
    sched.add(b)
    batch = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in batch.seqs] == [("a", 1), ("b", 16)]
    assert batch.seqs[0].samples and not batch.seqs[1].samples


def test_admission_limited_by_slots_and_running_cap():
    sched, _, slots = make(num_slots=3, max_running_requests=8)
    for i in range(4):
        sched.add(req(str(i), 4))
    batch = sched.schedule()
    assert len(batch.seqs) == 2 and slots.num_free == 0
    assert len(sched.waiting) == 2


def test_preemption_frees_and_requeues_youngest():
    sched, pages, slots = make(num_pages=9, page_size=4)  # 8 usable pages = 32 tokens
    a, b = req("a", 12, max_tokens=30), req("b", 12, max_tokens=30)
    sched.add(a)
    sched.add(b)
    preempted = []
    for _ in range(12):
        batch = sched.schedule()
        preempted += batch.preempted
        apply(batch)
        check_pages(sched)
        used = sum(len(r.page_ids) for r in sched.running)
        assert used + pages.num_free == pages.num_usable
    assert b in preempted and b.num_preemptions >= 1
    assert a.status is RequestStatus.RUNNING


def test_release_returns_everything():
    sched, pages, slots = make()
    r = req("a", 10)
    sched.add(r)
    apply(sched.schedule())
    sched.release(r)
    assert pages.num_free == pages.num_usable and slots.num_free == slots.num_usable
    assert not sched.has_work()


def admission_order(sched, depths):
    """Admit one request at a time (max_running_requests=1) under stubbed cached depths;
    returns the request ids in the order they were admitted."""
    sched.cache.cached_depth = lambda r: depths[r.request_id]
    order = []
    while sched.waiting:
        sched.schedule()
        (r,) = sched.running
        order.append(r.request_id)
        sched.release(r, finished=True)
    return order


def queue(sched, ids):
    for h, rid in enumerate(ids, start=1):
        r = req(rid, 8)
        r.handle = h
        sched.add(r)


def test_lpm_admits_the_longest_cached_prefix_first():
    depths = {"a": 0, "b": 8, "c": 16, "d": 8}
    fcfs, _, _ = make(max_running_requests=1)
    queue(fcfs, "abcd")
    assert admission_order(fcfs, depths) == list("abcd")
    lpm, _, _ = make(max_running_requests=1, policy="lpm")
    queue(lpm, "abcd")
    assert admission_order(lpm, depths) == list("cbda")  # ties in arrival order


def test_lpm_bypass_bound_prevents_starvation():
    """A cold request at the head lets exactly ``lpm_max_bypass`` cached ones pass."""
    depths = {"a": 0, **{c: 16 for c in "bcdef"}}
    sched, _, _ = make(max_running_requests=1, policy="lpm", lpm_max_bypass=2)
    queue(sched, "abcdef")
    assert admission_order(sched, depths) == list("bcadef")
    unbounded, _, _ = make(max_running_requests=1, policy="lpm", lpm_max_bypass=100)
    queue(unbounded, "abcdef")
    assert admission_order(unbounded, depths)[-1] == "a"
