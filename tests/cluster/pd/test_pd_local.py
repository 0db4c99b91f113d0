"""Prefill/decode disaggregation in one process: the OpenAI API over a ``PDEngineClient``
(a prefill and a decode ``ReplicaCore``, MTP and overlap on, hand-offs through
``LocalHandoffs``) answers exactly as a colocated replica with cache, speculation and
overlap off -- streamed or not, greedy and seeded, penalties, stop strings, a grammar,
n > 1 -- a follow-up turn skips the prefill replica, a failed prefill replica or a lost
hand-off costs a local prefill, and no slot or page is left held."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import httpx
import pytest

from cluster.api.http_api import make_api
from cluster.api.openai_server import OpenAIServer, ServerSettings
from cluster.pd.client import PDEngineClient
from cluster.pd.handoff import LocalHandoffs
from cluster.serving.engine_client import LocalEngineClient
from cluster.serving.replica_core import PDSide, ReplicaCore
from configs.schema import load_config

MAX_LOCAL = 8  # a page (4) + the new turn (3) + the answer's unaligned tail
BASE = {"device": "cpu", "dtype": "float32", "scheduler": {"chunked_prefill_size": 16}}
CACHE = {"page_size": 4, "max_kv_tokens": 4096, "max_mamba_slots": 48, "host_mamba_slots": 16, "host_kv_tokens": 2048}
REFERENCE = {
    **BASE,
    "cache": {"enable_prefix_cache": False, "page_size": 4},
    "scheduler": {**BASE["scheduler"], "overlap": False},
}
TESTED = {
    **BASE,
    "cache": CACHE,
    "scheduler": {**BASE["scheduler"], "overlap": True},
    "spec": {"method": "mtp", "num_draft_tokens": 3},
    "pd": {"prefill_replicas": 1, "decode_replicas": 1, "max_local_prefill_tokens": MAX_LOCAL},
    # every step's ledger invariants; every checkpoint published recomputed from its tokens
    "debug": {"check_invariants": True, "state_oracle_sample": 1.0},
}


class FailingClient:
    """A prefill deployment whose replica died."""

    def generate(self, req):
        raise RuntimeError("replica actor died")


class Env:
    def __init__(self, tiny_qwen_dir, loop):
        self.loop = loop
        model = {"model": str(tiny_qwen_dir)}

        def make(overrides, pd=None):
            return loop.run_until_complete(ReplicaCore.create(load_config(overrides={**overrides, **model}), pd=pd))

        self.handoffs = LocalHandoffs()
        self.reference = make(REFERENCE)
        self.prefill = make(TESTED, PDSide(5.0, replica_id="prefill-0"))
        self.decode = make(TESTED, PDSide(5.0, source=self.handoffs, replica_id="decode-0"))
        self.handoffs.stashes["prefill-0"] = self.prefill.pd.stash
        self.routes: list[str] = []
        self.tokenizer = self.reference.loop.engine.tokenizer
        self.ref_api = self._api(LocalEngineClient(self.reference))
        self.prefill_client = LocalEngineClient(self.prefill)
        self.pd_client = PDEngineClient(
            self.prefill_client, LocalEngineClient(self.decode), self._depth, MAX_LOCAL, self.routes.append
        )
        self.pd_api = self._api(self.pd_client)

    def _api(self, client):
        return make_api(OpenAIServer(client, self.tokenizer, ServerSettings("tiny", "tiny")))

    async def _depth(self, tokens):
        return await self.decode.loop.run(lambda e: e.local_depth(tokens))

    def post(self, app, body, stream=False):
        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                r = await c.post("/v1/completions", json={**body, "stream": stream}, timeout=120)
                assert r.status_code == 200, r.text
                return r.text if stream else r.json()

        return self.loop.run_until_complete(go())

    def counters(self, core, name):
        return dict(core.loop.engine.stats.labelled[name])

    def settled(self, core) -> bool:
        """Whether the engine is idle within a few seconds (a stop string or a cancel ends
        the request in the engine a step after the client saw its end)."""

        async def wait():
            for _ in range(100):
                if not await core.loop.run(lambda e: e.has_unfinished()):
                    return True
                await asyncio.sleep(0.05)
            return False

        return self.loop.run_until_complete(wait())

    def assert_no_leaks(self):
        for core in (self.prefill, self.decode):
            engine = core.loop.engine
            assert self.settled(core)
            c = engine.pool_counts()
            assert c["kv_pages_free"] + c["kv_pages_cached"] == c["kv_pages_usable"], c
            assert c["mamba_slots_free"] + c["mamba_slots_cached"] == c["mamba_slots_usable"], c
        assert len(self.prefill.pd.stash) == 0
        stats = self.decode.loop.engine.stats
        assert stats.counters["hybridserve_state_oracle_checks_total"] > 0
        assert stats.counters["hybridserve_state_oracle_mismatches_total"] == 0
        assert not dict(stats.labelled["hybridserve_invariant_violations_total"])


@pytest.fixture(scope="module")
def env(tiny_qwen_dir):
    loop = asyncio.new_event_loop()
    env = Env(tiny_qwen_dir, loop)
    yield env
    for core in (env.reference, env.prefill, env.decode):
        loop.run_until_complete(core.shutdown())
    loop.close()


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 131 + 7 * i) % 500 + 3 for i in range(n)]


def texts(body) -> list[tuple[str, str]]:
    return [(c["text"], c["finish_reason"]) for c in sorted(body["choices"], key=lambda c: c["index"])]


def streamed(raw: str) -> dict[int, str]:
    out: dict[int, str] = {}
    for line in raw.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                out[c["index"]] = out.get(c["index"], "") + c["text"]
    return out


CASES = {
    "greedy": {"max_tokens": 12, "temperature": 0},
    "greedy_n2_logprobs": {"max_tokens": 10, "temperature": 0, "n": 2, "logprobs": 3},
    "seeded_penalties": {"max_tokens": 12, "temperature": 1.0, "seed": 7, "presence_penalty": -1.5},
    "stop_min_tokens": {"max_tokens": 14, "temperature": 0, "min_tokens": 3, "stop": ["e"]},
    "json": {"max_tokens": 16, "temperature": 1.0, "seed": 3, "response_format": {"type": "json_object"}},
}


@pytest.mark.parametrize("case", list(CASES))
def test_pd_answers_as_the_colocated_reference(env, case):
    body = {"model": "tiny", "prompt": prompt(len(case), 40), **CASES[case]}
    before = env.counters(env.decode, "hybridserve_pd_transfers_total").get("imported", 0)
    expected = env.post(env.ref_api, body)
    got = env.post(env.pd_api, body)
    assert texts(got) == texts(expected)
    assert got["usage"]["completion_tokens"] == expected["usage"]["completion_tokens"]
    if "logprobs" in body:
        for a, b in zip(got["choices"], expected["choices"]):  # verify and decode sum in other orders
            a, b = a["logprobs"], b["logprobs"]
            assert a["tokens"] == b["tokens"] and a["text_offset"] == b["text_offset"]
            assert a["token_logprobs"] == pytest.approx(b["token_logprobs"], abs=1e-4)
            for ta, tb in zip(a["top_logprobs"], b["top_logprobs"]):
                assert ta.keys() == tb.keys() and list(ta.values()) == pytest.approx(list(tb.values()), abs=1e-4)
    assert env.routes[-1] == "prefill"
    assert env.counters(env.decode, "hybridserve_pd_transfers_total").get("imported", 0) > before
    stream = streamed(env.post(env.pd_api, {**body, "seed": body.get("seed", 0)} if "seed" in body else body, True))
    assert [stream[i] for i in sorted(stream)] == [t for t, _ in texts(expected)]
    env.assert_no_leaks()


def test_follow_up_turn_is_served_by_the_decode_cache(env):
    first = prompt(99, 48)
    body = {"model": "tiny", "max_tokens": 8, "temperature": 0}
    answer = env.post(env.pd_api, {**body, "prompt": first, "return_token_ids": True})["choices"][0]["token_ids"]
    follow = first + answer + prompt(5, 3)
    expected = env.post(env.ref_api, {**body, "prompt": follow})
    got = env.post(env.pd_api, {**body, "prompt": follow})
    assert env.routes[-2:] == ["prefill", "direct"]
    assert texts(got) == texts(expected)
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(follow) - MAX_LOCAL
    env.assert_no_leaks()


def test_failed_prefill_replica_and_lost_handoff_cost_a_local_prefill(env):
    body = {"model": "tiny", "max_tokens": 10, "temperature": 0, "prompt": prompt(31, 36)}
    expected = env.post(env.ref_api, body)
    env.pd_client.prefill = FailingClient()
    try:
        assert texts(env.post(env.pd_api, body)) == texts(expected)
        assert env.routes[-1] == "fallback"
    finally:
        env.pd_client.prefill = env.prefill_client
    env.handoffs.stashes.pop("prefill-0")
    lost = env.counters(env.decode, "hybridserve_pd_transfers_total").get("lost", 0)
    try:
        assert texts(env.post(env.pd_api, {**body, "prompt": prompt(32, 36)})) == texts(
            env.post(env.ref_api, {**body, "prompt": prompt(32, 36)})
        )
    finally:
        env.handoffs.stashes["prefill-0"] = env.prefill.pd.stash
    assert env.counters(env.decode, "hybridserve_pd_transfers_total")["lost"] == lost + 1
    env.prefill.pd.stash.expire()  # the unclaimed payload: dropped at its ttl in service
    env.prefill.pd.stash._entries.clear()
    env.assert_no_leaks()


def test_cancelling_in_either_phase_leaves_nothing_held(env):
    from cluster.serving.messages import Accepted, GenerateRequest
    from workers.sampling.params import SamplingParams

    async def cancel_after(n_items: int, rid: str) -> int:
        params = [SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)]
        stream = env.pd_client.generate(GenerateRequest(rid, prompt(77, 64), params))
        seen = 0
        async for item in stream:
            seen += 0 if isinstance(item, Accepted) else sum(len(c.new_token_ids) for c in item)
            if seen >= n_items:
                break
        stream.cancel()
        return seen

    assert env.loop.run_until_complete(cancel_after(0, "cancel-prefill")) == 0  # at Accepted: prefilling
    assert env.loop.run_until_complete(cancel_after(5, "cancel-decode")) >= 5  # decoding
    env.prefill.pd.stash._entries.clear()  # a hand-off its decode leg never pulled: dropped at its ttl
    env.assert_no_leaks()


class SlowSource:
    async def take(self, ticket):
        await asyncio.sleep(5)


def test_a_late_handoff_costs_a_local_prefill(env):
    body = {"model": "tiny", "max_tokens": 10, "temperature": 0, "prompt": prompt(41, 36)}
    pd = env.decode.pd
    env.decode.pd = replace(pd, source=SlowSource(), timeout_s=0.2)
    try:
        assert texts(env.post(env.pd_api, body)) == texts(env.post(env.ref_api, body))
    finally:
        env.decode.pd = pd
    assert env.counters(env.decode, "hybridserve_pd_transfers_total")["timeout"] == 1
    env.prefill.pd.stash._entries.clear()  # never pulled: dropped at its ttl in service
    env.assert_no_leaks()
