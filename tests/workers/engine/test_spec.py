"""MTP speculative decoding: greedy output equals plain decoding in every variant.

A random MTP head rarely drafts the right token, so one test swaps in an oracle drafter
(the expected continuation, with every third draft corrupted) to drive the verify path
through every acceptance length. The first tests run for every registered family with MTP
weights (``tiny_mtp_model_dir``); the rest exercise the engine on Qwen3-Next.
"""

from __future__ import annotations

import pytest
import torch

from tests.workers.engine.helpers import make_llm, random_prompts
from workers.sampling.params import SamplingParams
from workers.spec.drafter import MtpDrafter
from workers.state_spec import ATTENTION

P = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SPEC = {"method": "mtp", "num_draft_tokens": 3}


def spec_llm(model_dir, **overrides):
    overrides.setdefault("spec", SPEC)
    overrides.setdefault("debug", {"check_invariants": True})
    llm = make_llm(model_dir, **overrides)
    llm.engine.raise_on_violation = True
    return llm


def mixed(vocab: int) -> list[list[int]]:
    prompts = random_prompts(vocab, [2, 5, 9, 17, 30, 12, 23, 7], seed=31)
    return prompts + [prompts[4][:20] + p[:4] for p in prompts[:4]]


@pytest.fixture(scope="module")
def plain(tiny_mtp_model_dir):
    llm = make_llm(tiny_mtp_model_dir, cache={"enable_prefix_cache": False}, scheduler={"overlap": False})
    prompts = mixed(llm.engine.vocab_size)
    return prompts, [o.token_ids for o in llm.generate_ids(prompts, [P] * len(prompts))]


@pytest.mark.parametrize("overlap", [False, True])
def test_spec_greedy_equals_plain(tiny_mtp_model_dir, plain, overlap):
    prompts, expected = plain
    llm = spec_llm(tiny_mtp_model_dir, scheduler={"overlap": overlap})
    for _ in range(2):  # second pass: prefix hits + MTP
        assert [o.token_ids for o in llm.generate_ids(prompts, [P] * len(prompts))] == expected
    stats = llm.stats()
    assert stats["hybridserve_spec_draft_tokens_total"] > 0


@pytest.fixture
def oracle_drafts(monkeypatch, plain):
    """Drafts from the expected continuation; every third one is wrong."""
    prompts, expected = plain
    by_prompt = {tuple(p): p + e for p, e in zip(prompts, expected)}
    engines = []
    original = MtpDrafter._chain

    def chain(self, spans, hidden, last_pos):
        original(self, spans, hidden, last_pos)
        for span, t in zip(spans, last_pos):
            req = engines[0].outputs.requests.get(span.request_id)
            full = by_prompt.get(tuple(req.prompt_token_ids)) if req is not None else None
            if full is None:
                continue
            drafts = [full[t + 2 + j] if t + 2 + j < len(full) else 0 for j in range(self.k)]
            bad = (t + 1) % 3
            drafts[bad] = (drafts[bad] + 1) % 64
            self.draft_tokens[span.live_slot] = torch.tensor(drafts)

    monkeypatch.setattr(MtpDrafter, "_chain", chain)
    return engines


@pytest.mark.parametrize("overlap", [False, True])
def test_verify_commits_the_accepted_state(tiny_mtp_model_dir, plain, oracle_drafts, overlap):
    prompts, expected = plain
    llm = spec_llm(
        tiny_mtp_model_dir,
        scheduler={"overlap": overlap},
        cache={"mamba_track_interval": 8, "mamba_strategy": "extra_buffer_lazy"},
    )
    oracle_drafts.append(llm.engine)
    for _ in range(2):
        assert [o.token_ids for o in llm.generate_ids(prompts, [P] * len(prompts))] == expected
    stats = llm.stats()
    drafted = stats["hybridserve_spec_draft_tokens_total"]
    accepted = stats["hybridserve_spec_accepted_tokens_total"]
    assert 0.2 * drafted < accepted < drafted  # every acceptance length occurs
    assert stats["hybridserve_mamba_checkpoints_inserted_total"].get("decode", 0) > 0


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe_vl"])
def test_two_layer_mtp_head(tmp_path, arch):
    """``mtp_num_hidden_layers=2``: two KV layers, drafts chained through both, output unchanged."""
    from tools.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(arch, tmp_path, seed=4, mtp=True, mtp_num_hidden_layers=2)
    control = make_llm(ckpt, cache={"enable_prefix_cache": False}, scheduler={"overlap": False})
    prompts = mixed(control.engine.vocab_size)
    expected = [o.token_ids for o in control.generate_ids(prompts, [P] * len(prompts))]
    llm = spec_llm(ckpt, scheduler={"overlap": True, "chunked_prefill_size": 8})
    for _ in range(2):
        assert [o.token_ids for o in llm.generate_ids(prompts, [P] * len(prompts))] == expected
    engine = llm.engine
    assert engine.drafter.mtp.num_layers == 2
    assert engine.pools.kv.num_layers(ATTENTION) == engine.model.cache_spec().num_layers(ATTENTION) + 2
    assert llm.stats()["hybridserve_spec_draft_tokens_total"] > 0


SGLANG_INTERVAL = 16
SGLANG_PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def sglang_engine(model_dir, guard_off: bool = False, **extra):
    """Lazy checkpoints + MTP + overlap, page 1, a 24-slot pool, half the pending-slot
    allocations failing: the verify must write the grid-crossing state in place into the
    keep slot whose prefill checkpoint is about to be donated."""
    overrides = {
        "scheduler": {"overlap": True, "max_running_requests": 4},
        "spec": {"method": "mtp", "num_draft_tokens": 2},
        "cache": {
            "mamba_strategy": "extra_buffer_lazy",
            "mamba_track_interval": SGLANG_INTERVAL,
            "max_mamba_slots": 24,
            "page_size": 1,
        },
        "debug": {
            "check_invariants": not guard_off,
            "fail_pending_alloc_prob": 0.5,
            "disable_alias_guard": guard_off,
            "state_oracle_sample": 1.0,
        },
    }
    for key, value in extra.items():
        overrides[key] = {**overrides[key], **value}
    llm = make_llm(model_dir, **overrides)
    llm.engine.raise_on_violation = not guard_off
    return llm


@pytest.fixture(scope="module")
def sglang_passes(tiny_qwen_dir):
    """Warm-up prompts (fill the pool with unlocked checkpoints), 40 prompts one token short
    of the grid, then a second pass, newest first, of a follow-up turn per prompt (prompt + 2
    generated + 1 new token: it matches the grid checkpoint of the first verify) and the
    prompt again (its prefill checkpoint). Outputs from the cache-off, overlap-off control."""
    control = make_llm(tiny_qwen_dir, cache={"enable_prefix_cache": False}, scheduler={"overlap": False})
    vocab = control.engine.vocab_size
    warm = random_prompts(vocab, [SGLANG_INTERVAL - 1] * 12, seed=4)
    first = random_prompts(vocab, [SGLANG_INTERVAL - 1] * 40, seed=3)
    gen = [o.token_ids for o in control.generate_ids(first, [SGLANG_PARAMS] * 40)]
    news = random_prompts(vocab, [1] * 40, seed=5)
    second = [q for p, g, n in list(zip(first, gen, news))[::-1] for q in (p + g[:2] + n, p)]
    passes = {"warm": warm, "first": first, "second": second}
    expected = {
        name: [o.token_ids for o in control.generate_ids(ps, [SGLANG_PARAMS] * len(ps))] for name, ps in passes.items()
    }
    return passes, expected


def run_sglang(llm, passes):
    return {name: llm.generate_ids(ps, [SGLANG_PARAMS] * len(ps)) for name, ps in passes.items()}


@pytest.mark.parametrize("variant", ["full", "spec_off", "overlap_off"])
def test_lazy_spec_overlap_under_slot_pressure(tiny_qwen_dir, sglang_passes, variant):
    """The combination that broke SGLang, on the real model: every pass equals the control,
    and the second pass really is served from checkpoints the first pass published."""
    passes, expected = sglang_passes
    extra = {"spec_off": {"spec": {"method": "none"}}, "overlap_off": {"scheduler": {"overlap": False}}}
    llm = sglang_engine(tiny_qwen_dir, **extra.get(variant, {}))
    outs = run_sglang(llm, passes)
    for name in passes:
        assert [o.token_ids for o in outs[name]] == expected[name], name
    hits = [o.cached_tokens for o in outs["second"]]
    assert sum(h > 0 for h in hits) >= 6, hits
    stats = llm.stats()
    assert stats["hybridserve_invariant_violations_total"] == {}
    assert stats["hybridserve_state_oracle_checks_total"] > 0
    assert stats["hybridserve_state_oracle_mismatches_total"] == 0
    if variant == "full":
        assert SGLANG_INTERVAL in hits  # a follow-up resumed from the grid crossing
        assert SGLANG_INTERVAL - 2 in hits  # a prompt resumed from its prefill target
        assert stats["hybridserve_mamba_pending_alloc_failures_total"] > 0
        assert sum(stats["hybridserve_mamba_donations_skipped_total"].values()) > 0


def test_lazy_spec_overlap_guard_off_corrupts(tiny_qwen_dir, sglang_passes):
    """The same run with ``debug.disable_alias_guard``: donations of slots the in-flight
    verify writes publish states of the wrong depth, and reusing them changes outputs."""
    passes, expected = sglang_passes
    llm = sglang_engine(tiny_qwen_dir, guard_off=True)
    outs = run_sglang(llm, passes)
    assert [o.token_ids for o in outs["first"]] == expected["first"]  # no hits yet
    assert [o.token_ids for o in outs["second"]] != expected["second"]
    # The state oracle sees the published slots that do not hold their node's state.
    assert llm.stats()["hybridserve_state_oracle_mismatches_total"] > 0


def test_seeded_spec_sampling_is_reproducible(tiny_qwen_dir):
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True)
    prompts = random_prompts(512, [6, 13], seed=2)
    runs = [[o.token_ids for o in spec_llm(tiny_qwen_dir).generate_ids(prompts, [params] * 2)] for _ in range(2)]
    assert runs[0] == runs[1] and all(len(t) == 12 for t in runs[0])


def test_spec_needs_an_mtp_head(tiny_granite_dir, tiny_qwen_dir):
    with pytest.raises(ValueError, match="MTP head"):
        make_llm(tiny_granite_dir, spec=SPEC)
    with pytest.raises(ValueError, match="spec.method"):
        make_llm(tiny_qwen_dir, spec={"method": "draft"})  # a separate draft model: not served


def test_hundred_mixed_prompts_every_variant(tiny_qwen_dir):
    """Spec on/off × overlap on/off × cache on, against the plain control, 100 prompts."""
    import random

    rng = random.Random(5)
    vocab = 512
    bases = random_prompts(vocab, [rng.randrange(1, 60) for _ in range(70)], seed=50)
    shared = random_prompts(vocab, [24, 40], seed=51)
    prompts = bases + [shared[i % 2] + b[: rng.randrange(1, 8)] for i, b in enumerate(bases[:30])]
    params = [SamplingParams(max_tokens=rng.randrange(4, 14), temperature=0.0, ignore_eos=True) for _ in prompts]
    control = make_llm(tiny_qwen_dir, cache={"enable_prefix_cache": False}, scheduler={"overlap": False})
    expected = [o.token_ids for o in control.generate_ids(prompts, params)]
    for overlap in (False, True):
        for spec in ({"method": "none"}, SPEC):
            llm = spec_llm(tiny_qwen_dir, spec=spec, scheduler={"overlap": overlap}, cache={"mamba_track_interval": 16})
            got = [o.token_ids for o in llm.generate_ids(prompts, params)]
            assert got == expected, (overlap, spec)


def test_every_request_verifies_every_step_under_overlap(tiny_qwen_dir, monkeypatch):
    """MTP + overlap: a request whose verify is in flight verifies again in the next batch
    (chained, started on the device where the one before stopped), so once all have drafted,
    each batch verifies every running request and is launched while the one before runs."""
    llm = spec_llm(tiny_qwen_dir, scheduler={"overlap": True})
    engine = llm.engine
    verifying: list[int] = []
    on_launch = engine.scheduler.on_launch

    def count(batch):
        verifying.append(sum(s.is_verify for s in batch.seqs))
        on_launch(batch)

    monkeypatch.setattr(engine.scheduler, "on_launch", count)
    prompts = random_prompts(engine.vocab_size, [9] * 8, seed=12)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = [
        o.token_ids for o in make_llm(tiny_qwen_dir, scheduler={"overlap": False}).generate_ids(prompts, [params] * 8)
    ]
    assert [o.token_ids for o in llm.generate_ids(prompts, [params] * 8)] == expected
    stats = llm.stats()
    # A random head's drafts are rejected: each verify advances one token, ~22 verifies each.
    assert sum(n == 8 for n in verifying) >= 15, verifying
    steps = sum(stats["hybridserve_engine_steps_total"].values())
    assert stats["hybridserve_overlapped_steps_total"] >= 0.9 * steps
