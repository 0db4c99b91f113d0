"""The tiers on a two-node Ray cluster on this machine.

A head and a worker started with ``ray start`` as separate processes with separate
resources (``two_nodes.py``); the app's two engine replicas land one on each node, the
router index, metrics actor and checkpoint store on the head. Phase 1 runs a first turn of
12 sessions; scarce device slots make both replicas demote checkpoints into their host
tiers and commit them to the shared store. Then the worker node dies (SIGKILL to all its
processes). Phase 2 waits for Serve to bring the lost replica back on the head and runs the
second turns. Asserted: every answer equals a cache-off engine's; nothing committed to the
store was lost with the node (the store's actor owns its objects, on the head): every
session whose checkpoint was committed -- by either replica -- resumes from at least that
depth on whichever replica it lands, fetching from the store where needed
(``store_fetches{outcome="fetched"}``); what the dead replica held but never committed is
recomputed.
"""

from __future__ import annotations

import json

import pytest

from cluster.net import free_port
from tests.e2e.two_node_driver import sessions
from tests.e2e.two_nodes import TwoNodeCluster
from workers.cache.prefix_hash import prefix_hash_chain

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]
PAGE = 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = TwoNodeCluster(tmp_path_factory.mktemp("two_nodes"))
    try:
        yield c.start()
    finally:
        c.stop()


def node_of(owner: str, replica_nodes: dict[str, str]) -> str:
    """The node (head / worker) of the replica whose full id is ``owner``."""
    return replica_nodes[owner]


def deepest_owner(prompt: list[int], owners: dict[str, str]) -> tuple[int, str] | None:
    chain = prefix_hash_chain(prompt[: len(prompt) - 1], PAGE)
    for i in range(len(chain) - 1, -1, -1):
        if chain[i].hex() in owners:
            return (i + 1) * PAGE, owners[chain[i].hex()]
    return None


def test_worker_node_dies_the_store_survives_and_nothing_is_wrong(cluster, tiny_qwen_dir):
    port = free_port()
    common = ["--model", str(tiny_qwen_dir), "--http-port", str(port)]
    first = cluster.run_driver(common + ["phase1"], timeout_s=600)
    nodes = first["replica_nodes"]
    assert sorted(nodes.values()) == ["head", "worker"], nodes
    owner_nodes = {key: node_of(owner, nodes) for key, owner in first["store_owners"].items()}
    assert set(owner_nodes.values()) == {"head", "worker"}, first["store_owners"]
    assert first["store_node"] == "head"  # pinned there, whichever replica created it

    cluster.kill_worker()
    second = cluster.run_driver(common + ["--first", json.dumps(first), "phase2"], timeout_s=600)
    print(
        f"\n[two nodes] store objects before the kill {first['store_objects']}, "
        f"after {second['store_after']}; fetch outcomes after it {second['fetches']}; "
        f"cached {second['cached']}; hits by tier {second['hits']}; "
        f"committed {sorted(first['store_owners'].values())}; store on the {first['store_node']}"
    )
    assert set(second["replica_nodes"].values()) == {"head"} and len(second["replica_nodes"]) == 2
    assert second["wrong"] == []  # no request got a wrong answer
    assert second["fetches"].get("fetched", 0) >= 1  # the store's objects are used
    assert second["store_after"] >= first["store_objects"]
    committed_by = {"head": 0, "worker": 0}
    for i, (prompt, cached) in enumerate(zip(sessions(len(second["cached"])), second["cached"])):
        hit = deepest_owner(prompt, owner_nodes)
        if hit is not None:  # committed: survived, whoever committed it
            assert cached >= hit[0], (i, cached, hit)
            committed_by[hit[1]] += 1
    assert committed_by["worker"] >= 1, committed_by  # ... including the dead node's replica's
