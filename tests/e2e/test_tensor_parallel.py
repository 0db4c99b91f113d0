"""TP = 2 through the production path, on CPU: greedy tokens identical to TP = 1.

Each app's replica is rank 0 of a TP group whose rank 1 is a ``TPWorkerActor`` in the
replica's placement group (one bundle per rank), joined over gloo. Six prompts (two share
a 20-token prefix) are sent as one batched completion, twice: the second pass is served
from the prefix cache. Qwen3-Next also drafts with its MTP head. ``check_invariants``
makes the ranks compare a digest of their decisions after every step, so a rank that ran
a different step fails the request. The reference is the offline ``LLM`` at TP = 1 with
the same engine config.
"""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.conftest import SMALL_ENGINE
from tests.workers.engine.helpers import random_prompts

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]
MAX_TOKENS = 16


def prompts(vocab: int) -> list[list[int]]:
    ps = random_prompts(vocab, [5, 17, 9, 30, 12, 3], seed=11)
    ps[5] = ps[3][:20] + ps[5]
    return ps


def reference(model_dir: str, overrides: dict, batch: list[list[int]]) -> list[list[int]]:
    from workers.llm import LLM
    from workers.sampling.params import SamplingParams

    llm = LLM(model=model_dir, **{**SMALL_ENGINE, **overrides})
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate_ids(batch, [params] * len(batch))]


def complete(base_url: str, batch: list[list[int]]) -> tuple[list[list[int]], int]:
    body = {"prompt": batch, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    data = r.json()
    choices = sorted(data["choices"], key=lambda c: c["index"])
    return [c["token_ids"] for c in choices], data["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("arch", ["qwen3_next", "granitemoehybrid"])
def test_tp2_greedy_tokens_equal_tp1(deployed, tiny_qwen_dir, tiny_granite_dir, arch):
    import ray

    model_dir = str(tiny_qwen_dir if arch == "qwen3_next" else tiny_granite_dir)
    engine = {
        "debug": {"check_invariants": True},
        **({"spec": {"method": "mtp", "num_draft_tokens": 2}} if arch == "qwen3_next" else {}),
    }
    batch = prompts(512)
    expected = reference(model_dir, engine, batch)
    app = deployed(f"tp-{arch}", model_dir, overrides={**engine, "parallel": {"tensor_parallel_size": 2}})
    first, _ = complete(app.base_url, batch)
    again, cached = complete(app.base_url, batch)
    assert first == expected
    assert again == expected
    assert cached > 0
    groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
    assert any(list(g["bundles"].values()) == [{"CPU": 1.0}, {"CPU": 1.0}] for g in groups)
