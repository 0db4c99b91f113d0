"""Prefill/decode disaggregation on Ray Serve: one prefill and one decode replica (MTP,
overlap, host tier) behind one ingress answer the official ``openai`` client exactly as a
colocated app with cache, speculation and overlap off; a follow-up turn goes straight to
the decode replica; the hand-offs and routes are on the API port's ``/metrics``."""

from __future__ import annotations

import re

import httpx
import pytest
from openai import OpenAI

from tests.e2e.conftest import wait_until

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]
PD, REF = "pd", "pdref"
PD_ENGINE = {
    "cache": {"page_size": 4, "max_kv_tokens": 2048, "max_mamba_slots": 32, "host_mamba_slots": 16,
              "host_kv_tokens": 1024},
    "spec": {"method": "mtp", "num_draft_tokens": 3},
    "scheduler": {"overlap": True, "max_running_requests": 8, "max_batch_tokens": 512, "chunked_prefill_size": 32},
    "pd": {"prefill_replicas": 1, "decode_replicas": 1, "max_local_prefill_tokens": 16},
}  # fmt: skip
REF_ENGINE = {
    "cache": {"enable_prefix_cache": False, "page_size": 4, "max_kv_tokens": 2048, "max_mamba_slots": 32},
    "scheduler": {"overlap": False, "max_running_requests": 8, "max_batch_tokens": 512, "chunked_prefill_size": 32},
}


@pytest.fixture(scope="module")
def apps(deployed, tiny_qwen_dir):
    pd = deployed(PD, str(tiny_qwen_dir), overrides=PD_ENGINE, args={"model_name": PD})
    ref = deployed(REF, str(tiny_qwen_dir), overrides=REF_ENGINE, args={"model_name": REF})
    return pd, ref


def complete(app, model: str, prompt: list[int], **kw) -> tuple[list[int], str]:
    client = OpenAI(base_url=app.openai_base, api_key="none", max_retries=0)
    out = client.completions.create(model=model, prompt=prompt, extra_body={"return_token_ids": True}, **kw)
    return out.choices[0].token_ids, out.choices[0].text  # type: ignore[attr-defined]


def metric(app, name: str, label: str) -> float:
    text = httpx.get(app.metrics_url, timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{name}{{[^}}]*{label}[^}}]*}} ([0-9.e+]+)$", text, re.M))


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 97 + 11 * i) % 480 + 5 for i in range(n)]


def test_pd_app_answers_as_colocated_and_serves_follow_ups_at_decode(apps):
    pd, ref = apps
    kw = {"max_tokens": 16, "temperature": 0}
    for k in range(4):
        p = prompt(k, 40 + 7 * k)
        assert complete(pd, PD, p, **kw) == complete(ref, REF, p, **kw), k
    seeded = {"max_tokens": 12, "temperature": 1.0, "seed": 5, "presence_penalty": -1.0}
    assert complete(pd, PD, prompt(9, 50), **seeded) == complete(ref, REF, prompt(9, 50), **seeded)
    first = prompt(20, 60)
    answer, _ = complete(pd, PD, first, **kw)
    follow = first + answer + prompt(21, 4)
    assert complete(pd, PD, follow, **kw) == complete(ref, REF, follow, **kw)
    wait_until(lambda: metric(pd, "hybridserve_pd_requests_total", 'route="direct"') >= 1, timeout_s=30)
    assert metric(pd, "hybridserve_pd_requests_total", 'route="prefill"') >= 6
    wait_until(lambda: metric(pd, "hybridserve_pd_transfers_total", 'outcome="imported"') >= 6, timeout_s=30)
    assert metric(pd, "hybridserve_pd_handoffs_total", 'outcome="exported"') >= 6
    roles = {r.get("replica_label", "")[:7] for r in httpx.get(f"{pd.base_url}/debug/replicas").json()["replicas"]}
    assert roles == {"prefill", "decode-"}
