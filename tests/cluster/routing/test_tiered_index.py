"""Routing over tiers: the index keeps device, host and store checkpoints apart, and the
policy scores the expected recompute saved (device depth, host depth x host value, store
depth x store value) minus load."""

from __future__ import annotations

import random

import pytest

from cluster.routing.router_actor import STORE_OWNER, RouterIndexState
from cluster.routing.routing_policy import ReplicaView, RouterSettings, decide, expected_saved, views_from
from configs.schema import load_config
from workers.cache.records import CheckpointEvicted, CheckpointInserted

TOKENS = tuple(range(40))


def ins(depth: int, tier: str) -> CheckpointInserted:
    return CheckpointInserted(depth, b"", TOKENS[:depth], tier)


def test_events_land_in_their_tier_and_the_store_outlives_replicas():
    state = RouterIndexState(forget_after_s=1e9)
    state.apply("a", [ins(8, "device"), ins(24, "host")])
    state.apply("b", [ins(32, "store")])  # committed through replica b
    report = state.match(list(TOKENS), ["a", "b"], 39)
    assert report.depths == {"a": 8, "b": 0} and report.host_depths == {"a": 24, "b": 0}
    assert report.store_depth == 32
    state.forget(["a", "b"])  # both replicas gone: the store stays
    report = state.match(list(TOKENS), ["c"], 39)
    assert report.depths == {"c": 0} and report.host_depths == {"c": 0} and report.store_depth == 32
    state.apply("c", [CheckpointEvicted(32, b"", TOKENS[:32], "store")])  # found lost, dropped
    assert state.match(list(TOKENS), ["c"], 39).store_depth == 0
    state.apply("c", [ins(16, "store")])
    state.clear_store()
    assert state.summary()["store_checkpoints"] == 0 and STORE_OWNER == "store"


def test_expected_saved_weighs_each_tier():
    s = RouterSettings(host_hit_value=0.5, store_hit_value=0.25)
    assert expected_saved(ReplicaView("a", 10, 0, host_depth=40), s) == 20
    assert expected_saved(ReplicaView("a", 30, 0, host_depth=40, store_depth=200), s) == 50
    assert expected_saved(ReplicaView("a", 30, 0), s) == 30
    with pytest.raises(ValueError, match=r"store_hit_value \(0.5\) must be <= router.host_hit_value \(0.2\)"):
        load_config(overrides={"router": {"host_hit_value": 0.2, "store_hit_value": 0.5}})


def test_the_store_counts_only_where_the_replica_would_fetch():
    """``store_min_gain_tokens`` (the fetch cost model's break-even): a store entry less than
    that deeper than what the replica holds would be recomputed, so it earns nothing --
    crediting it sent first turns to idle replicas that then computed their whole prompt."""
    s = RouterSettings(store_min_gain_tokens=200)
    assert expected_saved(ReplicaView("idle", 0, 0, store_depth=192), s) == 0  # refused: 192 < 200
    assert expected_saved(ReplicaView("idle", 0, 0, store_depth=256), s) == 128  # fetched
    assert expected_saved(ReplicaView("a", 192, 0, store_depth=384), RouterSettings()) == 192
    assert expected_saved(ReplicaView("a", 0, 0, host_depth=100, store_depth=250), s) == 90
    views = views_from(["busy", "idle"], {"busy": 192}, {"busy": 6, "idle": 0}, store_depth=192)
    assert decide(views, RouterSettings(), random.Random(0)).ranks[0] == ["idle"]  # 96 - 0 ties 192 - 96
    assert decide(views, s, random.Random(0)).ranks[0] == ["busy"]
    with pytest.raises(ValueError, match=r"router.store_min_gain_tokens.*-1"):
        load_config(overrides={"router.store_min_gain_tokens": -1})


def test_a_host_checkpoint_attracts_and_the_store_lets_load_win():
    s = RouterSettings(load_penalty_tokens=16, min_match_tokens=16)
    rng = random.Random(0)
    # b holds the prompt's checkpoint on its host only: it is still the best place.
    views = views_from(["a", "b"], {"a": 0, "b": 0}, {"a": 0, "b": 0}, host_depths={"b": 200})
    assert decide(views, s, rng).ranks[0] == ["b"] and decide(views, s, rng).reason == "prefix"
    # a holds it on its device but is busy; the store has it too, so idle c can fetch it.
    views = views_from(["a", "c"], {"a": 200}, {"a": 8, "c": 0}, store_depth=200)
    d = decide(views, s, rng)
    assert d.ranks[0] == ["c"] and d.depth == 100  # 200 x 0.5 - 0 beats 200 - 16 x 8
    # Without the store the same load keeps it on a.
    views = views_from(["a", "c"], {"a": 200}, {"a": 8, "c": 0})
    assert decide(views, s, rng).ranks[0] == ["a"]
    # Only the store, shallow: below min_match_tokens after its discount -> cold.
    views = views_from(["a", "c"], {}, {"a": 0, "c": 0}, store_depth=24)
    assert decide(views, s, rng).reason == "cold"
