"""Host pools and their copies, on pools of every kind of state -- including kinds no model
has yet -- so nothing in the tier names a tensor: whatever the spec holds is moved."""

from __future__ import annotations

import torch

from workers.device_pools import build_pools
from workers.state_spec import CacheSpec, StateGroup, StateKind, TensorSpec, attention_kind, conv_ssm_kind
from workers.tiers.host_pools import HostPools, page_rows
from workers.tiers.payload import CheckpointPayload, payload_problem
from workers.tiers.storage import TensorTierStorage

PAGE = 4
SPEC = CacheSpec(
    (
        StateGroup(attention_kind(2, 8, 6), 3),
        StateGroup(conv_ssm_kind("gdn", 12, 4, (2, 3, 5)), 2),
        StateGroup(StateKind("lightning", False, (TensorSpec("kv", (2, 4, 4), "bfloat16"),)), 1),  # no conv
        StateGroup(StateKind("latent", True, (TensorSpec("c", (7,)),)), 2),  # a new paged kind
    )
)


def pools(seed: int = 0, on: torch.device = torch.device("cpu")):
    device = build_pools(SPEC, num_pages=9, page_size=PAGE, num_slots=6, dtype=torch.float32, device=on)
    gen = torch.Generator().manual_seed(seed)
    for t in list(device.kv.tensors()) + list(device.mamba.tensors()):
        t.copy_(torch.randn(t.shape, generator=gen).to(t.device, t.dtype))
    return device, HostPools.mirror(device, num_pages=7, num_slots=4)


def test_the_mirror_has_every_tensor_with_its_shape_and_dtype():
    device, host = pools()
    for side, dev in (("kv", device.kv.groups), ("slots", device.mamba.groups)):
        mirror = getattr(host, side)
        assert {k: set(v) for k, v in mirror.items()} == {k: set(v) for k, v in dev.items()}
        for kind, tensors in dev.items():
            for name, t in tensors.items():
                h = mirror[kind][name]
                assert h.dtype == t.dtype and h.shape[0] == t.shape[0] and h.shape[2:] == t.shape[2:]
                assert h.device.type == "cpu"
    assert host.slots["lightning"]["kv"].dtype == torch.bfloat16


def test_copy_out_then_in_moves_every_kind_exactly():
    device, host = pools()
    storage = TensorTierStorage(device, host)
    assert storage.copy_out(slot=3, pages=[2, 5], host_slot=1, host_pages=[4, 6])
    job = storage.copy_in(host_slot=1, host_pages=[4, 6], slots=[1, 2], pages=[7, 8])
    assert job.done() and job.result()
    for t in device.mamba.tensors():
        assert torch.equal(t[:, 1], t[:, 3]) and torch.equal(t[:, 2], t[:, 3])
    for t in device.kv.tensors():
        assert torch.equal(t[:, page_rows([7, 8], PAGE)], t[:, page_rows([2, 5], PAGE)])
    # Untouched entries stay as they were (a copy writes its destinations only).
    before = [t[:, 4].clone() for t in device.mamba.tensors()]
    storage.copy_in(1, [4], [5], [3]).result()
    assert all(torch.equal(b, t[:, 4]) for b, t in zip(before, device.mamba.tensors()))


def test_a_corrupt_copy_reports_failure_and_writes_garbage_not_the_source():
    device, host = pools()
    storage = TensorTierStorage(device, host)
    assert not storage.copy_out(3, [2], 1, [4], corrupt=True)
    assert not any(
        torch.equal(h[:, 1], d[:, 3]) for h, d in zip(host.slots["gdn"].values(), device.mamba.groups["gdn"].values())
    )
    storage.copy_out(3, [2], 1, [4])
    assert not storage.copy_in(1, [4], [2], [6], corrupt=True).result()
    assert not torch.equal(device.mamba.groups["gdn"]["ssm"][:, 2], device.mamba.groups["gdn"]["ssm"][:, 3])


def test_payload_round_trip_and_its_validation():
    device, host = pools()
    storage = TensorTierStorage(device, host)
    tokens = tuple(range(8))
    from workers.cache.prefix_hash import prefix_hash

    storage.copy_out(3, [2, 5], 1, [4, 6])
    payload = CheckpointPayload.build(tokens, PAGE, prefix_hash(tokens, PAGE), "fp", storage.read_host(1, [4, 6]))
    layout = storage.layout()
    assert payload_problem(payload, PAGE, "fp", layout) is None
    assert payload.nbytes == storage.nbytes(1, 2)
    # Into other host entries, from the second page on (the first is already there), and back out.
    storage.write_host(2, [5], payload.tensors(), first_page=1)
    storage.copy_in(2, [5], [4], [1]).result()
    for t in device.mamba.tensors():
        assert torch.equal(t[:, 4], t[:, 3])
    for t in device.kv.tensors():
        assert torch.equal(t[:, page_rows([1], PAGE)], t[:, page_rows([5], PAGE)])
    problems = {
        "page size": payload_problem(payload, 8, "fp", layout),
        "fingerprint": payload_problem(payload, PAGE, "other", layout),
        "hash": payload_problem(
            payload.__class__(tokens[:4] + (9, 9, 9, 9), PAGE, payload.prefix_hash, "fp", payload.data),
            PAGE,
            "fp",
            layout,
        ),
        "key": payload_problem(payload, PAGE, "fp", layout, expected_hash=b"x" * 16),
        "layout": payload_problem(payload, PAGE, "fp", {**layout, "slots": {"gdn": layout["slots"]["gdn"]}}),
        "type": payload_problem({"not": "a payload"}, PAGE, "fp", layout),
    }
    assert all(problems.values()), problems
