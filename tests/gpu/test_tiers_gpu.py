"""The host tier's copies on CUDA (``workers/tiers/storage.py``'s GPU path): pinned host
pools, copies on the storage's own stream, a demotion that has landed on the host when it
returns, and a promotion that is an event polled for completion. The same pools as the
CPU tests (every kind of state, kinds no model has yet included)."""

from __future__ import annotations

import torch

from tests.workers.tiers.test_storage import PAGE, pools
from workers.tiers.host_pools import page_rows
from workers.tiers.storage import EventJob, TensorTierStorage


def _equal_entries(a, b, a_idx, b_idx) -> bool:
    return all(torch.equal(a[k][n][:, a_idx].cpu(), b[k][n][:, b_idx].cpu()) for k in a for n in a[k])


def test_pinned_copies_on_a_copy_stream_move_every_kind_exactly():
    device, host = pools(on=torch.device("cuda"))
    assert all(t.is_pinned() for g in (*host.slots.values(), *host.kv.values()) for t in g.values())
    storage = TensorTierStorage(device, host)
    assert storage.stream is not None
    assert storage.copy_out(3, [2, 5], 1, [4, 6])  # synchronous: on the host now
    assert _equal_entries(host.slots, device.mamba.groups, [1], [3])
    assert _equal_entries(host.kv, device.kv.groups, page_rows([4, 6], PAGE), page_rows([2, 5], PAGE))
    job = storage.copy_in(1, [4, 6], [1, 2], [7, 8])
    assert isinstance(job, EventJob) and job.result() and job.done()
    assert _equal_entries(device.mamba.groups, device.mamba.groups, [1], [3])
    assert _equal_entries(device.mamba.groups, device.mamba.groups, [2], [3])
    assert _equal_entries(device.kv.groups, device.kv.groups, page_rows([7, 8], PAGE), page_rows([2, 5], PAGE))
    torch.cuda.synchronize()
