"""The process group of one TP group, without global ``torch.distributed`` state.

Two groups share one ``TCPStore`` rendezvous (rank 0 hosts it on a free port):

- the *model* group (gloo on CPU, NCCL on CUDA) carries the all-reduces of the
  row-parallel layers; its timeout bounds how long a rank waits for a dead peer;
- the *control* group (always gloo) carries the step messages rank 0 broadcasts. Ranks
  1..N-1 wait on it while the engine is idle, so its timeout is very long; a peer that
  dies closes its sockets and fails the wait at once.

No ``init_process_group``: the groups are plain objects, so a process may hold several
(tests run ranks as threads or processes side by side) and nothing global is touched.
"""
from __future__ import annotations

import pickle
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

MODEL_TIMEOUT = timedelta(seconds=300)     # connect + every all-reduce
CONTROL_TIMEOUT = timedelta(days=30)       # ranks 1..N-1 idle-wait for the next step
STORE_TIMEOUT = timedelta(seconds=300)


class Comm(Protocol):
    """What the sharded layers need: their rank and an in-place sum over the group."""

    rank: int
    world_size: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of one TP group meet (rank 0's TCPStore)."""

    host: str
    port: int
    world_size: int


def open_rendezvous(host: str, world_size: int) -> tuple[dist.TCPStore, Rendezvous]:
    """Rank 0: host the store on a free port of ``host``; hand the Rendezvous to the others."""
    store = dist.TCPStore(host, 0, world_size, is_master=True, timeout=STORE_TIMEOUT,
                          wait_for_workers=False)
    return store, Rendezvous(host, store.port, world_size)


def joined_key(rank: int) -> str:
    return f"hybridserve/joined/{rank}"


def wait_joined(store: dist.TCPStore, world_size: int, alive: Any = None,
                timeout_s: float = STORE_TIMEOUT.total_seconds()) -> None:
    """Rank 0: wait until every other rank has reached the store.

    ``alive()`` is polled meanwhile and should raise when a rank has failed (its launcher
    knows how), so a worker that dies while starting fails rank 0 at once instead of
    after the connect timeout.
    """
    keys = [joined_key(r) for r in range(1, world_size)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        if alive is not None:
            alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"tensor-parallel ranks did not join within {timeout_s:.0f}s")
        time.sleep(0.05)


def _gloo(store: dist.Store, rank: int, size: int, host: str, timeout: timedelta) -> Any:
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, size, opts)


def _nccl(store: dist.Store, rank: int, size: int, timeout: timedelta) -> Any:
    cls = getattr(dist, "ProcessGroupNCCL", None)
    if cls is None:
        raise ValueError("device cuda with tensor_parallel_size > 1 needs a torch build with NCCL")
    opts = cls.Options()
    opts._timeout = timeout
    return cls(store, rank, size, opts)


class TPGroup:
    """One rank's membership of a TP group (see the module docstring)."""

    def __init__(self, rendezvous: Rendezvous, rank: int, device: torch.device,
                 store: dist.TCPStore | None = None) -> None:
        if not 0 <= rank < rendezvous.world_size:
            raise ValueError(f"rank {rank} is outside world size {rendezvous.world_size}")
        if store is None:
            store = dist.TCPStore(rendezvous.host, rendezvous.port, rendezvous.world_size,
                                  is_master=False, timeout=STORE_TIMEOUT)
        if rank:
            store.set(joined_key(rank), "1")
        self.rank, self.world_size, self.device = rank, rendezvous.world_size, device
        self._store = store
        size, host = rendezvous.world_size, rendezvous.host
        if device.type == "cuda":
            torch.cuda.set_device(device.index if device.index is not None else torch.cuda.current_device())
            self._model = _nccl(dist.PrefixStore("model", store), rank, size, MODEL_TIMEOUT)
        else:
            self._model = _gloo(dist.PrefixStore("model", store), rank, size, host, MODEL_TIMEOUT)
        self._control = _gloo(dist.PrefixStore("control", store), rank, size, host, CONTROL_TIMEOUT)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` (contiguous) over the group, in place; every rank gets the same bits."""
        self._model.allreduce([tensor]).wait()
        return tensor

    def check_same(self, value: int, what: str) -> None:
        """Raise on every rank unless all ranks passed the same ``value`` (a debug check)."""
        t = torch.tensor([value, -value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self._control.allreduce([t], opts).wait()
        if int(t[0]) != value or int(t[1]) != -value:
            raise RuntimeError(f"tensor-parallel ranks diverged: {what} differs between ranks "
                               f"(rank {self.rank} has {value:#x})")

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        """Rank 0 sends ``payload``; every rank returns it (two gloo broadcasts)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        size = torch.tensor([len(payload) if self.rank == 0 and payload is not None else 0],
                            dtype=torch.int64)
        self._control.broadcast([size], opts).wait()
        if self.rank == 0:
            assert payload is not None
            buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        else:
            buf = torch.empty(int(size[0]), dtype=torch.uint8)
        self._control.broadcast([buf], opts).wait()
        return payload if self.rank == 0 and payload is not None else buf.numpy().tobytes()

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (pickled; only ever between ranks of one group)."""
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == 0 else None
        return pickle.loads(self.broadcast_bytes(payload))

    def abort(self) -> None:
        """Close the sockets so that peers blocked on this rank fail now, not at a timeout."""
        for pg in (self._model, self._control):
            for name in ("abort", "shutdown"):
                fn = getattr(pg, name, None)
                if callable(fn):
                    try:
                        fn()
                        break
                    except Exception:  # noqa: BLE001 - best effort while failing
                        continue
