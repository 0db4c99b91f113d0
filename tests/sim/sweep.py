"""Random engine configurations and workloads for the simulation sweep (guard on).

Each case draws a strategy, page size, track interval, draft count, overlap, chunking,
concurrency, pool sizes, forced pending-allocation failures, an acceptance script, stop
tokens and aborts, then runs three rounds (prompts with shared prefixes, the same prompts
newest first, follow-up turns) and checks every oracle plus the analytic greedy output.

``KNOWN_ENGINE_BUGS`` (see test_engine_bugs.py) keeps the draw away from the conditions of
bugs that are still open; flip a flag to False once its fix lands.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from tests.sim.harness import Sim
from tests.sim.toy import chain
from workers.sampling_params import SamplingParams

KNOWN_ENGINE_BUGS = {
    "mixed_verify_widths": False,           # fixed: verify scratch slots overlapped (step_inputs)
    "preempt_scheduled": False,             # fixed: preemption of a request scheduled this step
    "no_buffer_finish_inflight_verify": False,  # fixed: no_buffer published an advanced live slot
}


@dataclass
class Case:
    seed: int
    overrides: dict[str, Any]
    script_kind: str
    max_tokens: int
    stop_prob: float
    abort_prob: float

    def script(self, request_id: str, position: int, first: bool, k: int) -> int:
        if self.script_kind == "none":
            return 0
        if self.script_kind == "all":
            return k
        salt = chain([position, self.seed], chain(request_id.encode())).digest % (k + 1)
        return k if first and self.script_kind == "first_all" else salt


def draw(seed: int) -> Case:
    rng = random.Random(seed)
    bugs = KNOWN_ENGINE_BUGS
    strategy = rng.choice(["extra_buffer", "extra_buffer_lazy", "extra_buffer_lazy", "no_buffer"])
    page = 1 if strategy == "no_buffer" else rng.choice([1, 1, 2, 4, 8])
    k = rng.choice([0, 1, 2, 3, 4])
    overlap = rng.random() < 0.8
    chunk = rng.choice([3, 5, 8, 16, 64])
    max_running = rng.choice([1, 2, 3, 4, 6])
    per_request = {"no_buffer": 1, "extra_buffer": 3, "extra_buffer_lazy": 2}[strategy]
    slots = max_running * per_request + rng.choice([0, 1, 4, 12])
    max_tokens = rng.choice([1, 2, 5, 9, 17])
    budget = rng.choice([chunk, 32, 512])
    if bugs["mixed_verify_widths"]:
        budget = max(budget, max_running * max(chunk, k + 1))     # no verify cut by the budget
    kv = rng.choice([None, 120, 600])
    if bugs["preempt_scheduled"] or bugs["mixed_verify_widths"]:
        kv = None                        # no preemption, no verify cut by max_model_len
    stop_prob = rng.choice([0.0, 0.3])
    if bugs["no_buffer_finish_inflight_verify"] and strategy == "no_buffer" and k and overlap:
        stop_prob = 0.0
    overrides = {
        "cache": {"mamba_strategy": strategy, "page_size": page,
                  "mamba_track_interval": rng.choice([4, 8, 16, 32]),
                  "max_mamba_slots": slots, "max_kv_tokens": kv or 16384},
        "scheduler": {"overlap": overlap, "max_running_requests": max_running,
                      "chunked_prefill_size": chunk, "max_batch_tokens": max(chunk, budget)},
        "spec": {"method": "mtp" if k else "none", "num_draft_tokens": max(k, 1)},
        "debug": {"fail_pending_alloc_prob": rng.choice([0.0, 0.0, 0.3, 1.0])},
    }
    return Case(seed, overrides, rng.choice(["first_all", "salted", "none", "all"]), max_tokens,
                stop_prob, rng.choice([0.0, 0.0, 0.05]))


def run_case(model_dir, case: Case) -> dict[str, Any]:
    """Run the case; returns the harness summary. Raises AssertionError on any finding."""
    rng = random.Random(case.seed + 1)
    with Sim(model_dir, case.overrides, script=case.script) as sim:
        v, limit = sim.vocab, sim.engine.max_model_len
        bases = [[rng.randrange(v.low, v.high) for _ in range(rng.randrange(1, 40))] for _ in range(4)]
        prompts = []
        for _ in range(rng.randrange(6, 14)):
            base = rng.choice(bases)
            tail = [rng.randrange(v.low, v.high) for _ in range(rng.randrange(1, 20))]
            p = base[: rng.randrange(0, len(base) + 1)] + tail
            prompts.append(p[: limit - 2])
        aborted: set[str] = set()

        def on_step(sim: Sim, request_ids: list[str]):
            outs = []
            if case.abort_prob:
                for rid in request_ids:
                    if rid in sim.engine.requests and rng.random() < case.abort_prob:
                        out = sim.engine.abort(rid)
                        if out is not None:
                            aborted.add(rid)
                            outs.append(out)
            return outs

        rounds = [prompts, prompts[::-1],
                  [(p + v.greedy(p, case.max_tokens)[: rng.randrange(0, case.max_tokens + 1)]
                    + [rng.randrange(v.low, v.high)])[: limit - 2] for p in prompts]]
        for n, batch in enumerate(rounds):
            params, expected = [], []
            for p in batch:
                want = v.greedy(p, case.max_tokens)[: limit - len(p)]
                if len(want) > 1 and rng.random() < case.stop_prob:
                    stop = want[rng.randrange(len(want))]
                    params.append(SamplingParams(max_tokens=case.max_tokens, temperature=0.0, ignore_eos=True,
                                                 stop_token_ids=(stop,)))
                    want = want[: want.index(stop) + 1]
                else:
                    params.append(SamplingParams(max_tokens=case.max_tokens, temperature=0.0, ignore_eos=True))
                expected.append(want)
            outs = sim.run(batch, params, on_step=on_step)
            for i, (out, want) in enumerate(zip(outs, expected)):
                got = out.token_ids
                ok = got == want[: len(got)] if out.request_id in aborted else got == want
                assert ok, f"round {n} prompt {i}: {got} != {want}"
            s = sim.summary()
            for key in ("aliased", "corruptions", "keep_label_mismatches", "live_mismatches"):
                assert not s[key], (n, key, s)
            assert s["violations"] == {}, (n, sorted(sim.oracles.violation_messages)[:3])
        counts = sim.engine.pool_counts()
        assert counts["mamba_slots_free"] + counts["mamba_slots_cached"] == counts["mamba_slots_usable"]
        assert counts["kv_pages_free"] + counts["kv_pages_cached"] == counts["kv_pages_usable"]
        return s
