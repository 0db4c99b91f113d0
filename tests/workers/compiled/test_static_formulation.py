"""What a compiled step computes, checked without the compiler (fast): ``torch.compile``
replaced by the step itself run eagerly under ``kernels.static.static_formulation()``. The
padded batches, the traced attention and MoE, the verify fast path and the one-call draft
chain then run exactly as they would be traced, so on both original tiny families greedy
output equals the eager engine's, and no step reads the host (``tests/gpu/host_reads``:
what a CUDA graph could not hold)."""

from __future__ import annotations

import pytest
import torch

from kernels.static import static_formulation
from tests.gpu.host_reads import host_reads
from tests.workers.engine.helpers import make_llm, random_prompts
from workers.sampling.params import SamplingParams

P = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
BUCKETS = (2, 4)
CASES = [
    ("qwen3_next", {"method": "mtp", "num_draft_tokens": 2}),
    ("qwen3_next", {"method": "none"}),
    ("granitemoehybrid", {"method": "none"}),
]


class EagerStatic:
    """Stands in for ``torch.compile``: runs the function eagerly in its traced formulation,
    recording the host reads and the calls."""

    def __init__(self) -> None:
        self.reads: list[str] = []
        self.calls = 0

    def __call__(self, fn, **_kwargs):
        def run(*args):
            out = []
            with static_formulation():
                self.reads += host_reads(lambda: out.append(fn(*args)))
            self.calls += 1
            return out[0]

        return run


@pytest.mark.parametrize("name,spec", CASES)
def test_static_steps_equal_eager_without_host_reads(monkeypatch, tiny_checkpoint, name, spec):
    path = tiny_checkpoint(name)
    eager = make_llm(
        path, compile={"enabled": False}, cache={"enable_prefix_cache": False}, scheduler={"overlap": False}
    )
    prompts = random_prompts(eager.engine.vocab_size, [5, 11, 8, 14, 6], seed=21)
    fake = EagerStatic()
    monkeypatch.setattr(torch, "compile", fake)
    static = make_llm(path, spec=spec, scheduler={"overlap": True}, compile={"enabled": True, "batch_sizes": BUCKETS})
    warm_calls = fake.calls
    for n in (1, 3, 5):  # 1, 3: padded up; 5: above the buckets (eager)
        expected = [o.token_ids for o in eager.generate_ids(prompts[:n], [P] * n)]
        assert [o.token_ids for o in static.generate_ids(prompts[:n], [P] * n)] == expected, n
    assert fake.calls > warm_calls
    assert fake.reads == []


def test_static_drafts_equal_the_eager_drafters(monkeypatch, tiny_qwen_dir):
    """Drafts do not change greedy output (a verify rejects a wrong one), so they are compared
    directly: the one-call drafting after a verify (catch-up + chain) and the chain alone
    leave the same draft registers and acceptance counts as the eager drafter."""
    spec = {"method": "mtp", "num_draft_tokens": 3}
    eager = make_llm(tiny_qwen_dir, spec=spec, compile={"enabled": False})
    monkeypatch.setattr(torch, "compile", EagerStatic())
    static = make_llm(tiny_qwen_dir, spec=spec, compile={"enabled": True, "batch_sizes": BUCKETS})
    prompts = random_prompts(eager.engine.vocab_size, [5, 11, 8], seed=22)
    for llm in (eager, static):
        llm.generate_ids(prompts, [P] * 3)
    chain = static.engine.drafter.compiled_chain
    assert sum(chain.num_verify_calls.values()) > 0 and sum(chain.num_calls.values()) > 0
    assert torch.equal(static.engine.drafter.draft_tokens, eager.engine.drafter.draft_tokens)
    keys = ("hybridserve_spec_draft_tokens_total", "hybridserve_spec_accepted_tokens_total")
    assert [static.stats()[k] for k in keys] == [eager.stats()[k] for k in keys]


def test_decode_steps_with_a_checkpoint_stay_compiled(monkeypatch, tiny_qwen_dir):
    """A decode step that also checkpoints (a track-grid crossing, the end of the output) is
    still a decode step: it runs in its bucket and the runner copies the live slot into the
    checkpoint slot afterwards, so every one of a request's decode steps is compiled (an
    eager step per checkpoint before) and greedy output equals the cache-off engine's."""
    monkeypatch.setattr(torch, "compile", EagerStatic())
    llm = make_llm(tiny_qwen_dir, cache={"mamba_track_interval": 8}, compile={"enabled": True, "batch_sizes": (1,)})
    ref = make_llm(tiny_qwen_dir, compile={"enabled": False}, cache={"enable_prefix_cache": False})
    prompt = random_prompts(llm.engine.vocab_size, [6], seed=7)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    steps = llm.engine.runner.compiled
    before = sum(steps.num_calls.values())
    out = llm.generate_ids(prompt, [params])[0]
    assert sum(steps.num_calls.values()) - before == params.max_tokens - 1
    assert out.token_ids == ref.generate_ids(prompt, [params])[0].token_ids
    turn2 = [prompt[0] + out.token_ids[:12]]
    again = llm.generate_ids(turn2, [params])[0]
    assert again.cached_tokens >= 16  # a checkpoint written by a compiled decode step
    assert again.token_ids == ref.generate_ids(turn2, [params])[0].token_ids
