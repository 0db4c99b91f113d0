"""The process group of one TP group, without global ``torch.distributed`` state.

Two groups share one ``TCPStore`` rendezvous (rank 0 hosts it on a free port):

- the *model* group (gloo on CPU, NCCL on CUDA) carries the all-reduces of the
  row-parallel layers;
- the *control* group (always gloo) carries the messages rank 0 broadcasts (the pool
  layout, each step, ``Stop``) and the debug digest check.

Liveness: every wait on a peer ends within ``Rendezvous.timeout_s`` (``PEER_TIMEOUT_S``
unless the launcher chose another) and then raises -- the store connect, ``wait_joined``,
the connect of both groups, every all-reduce, every broadcast rank 0 sends (a gloo send
waits until the receiver has posted its receive, so a live rank that stalls would
otherwise hold rank 0 for as long as the group's timeout). The one exception is ranks
1..N-1 waiting for rank 0's next message (``idle=True``): rank 0 may build for long or
idle for days, so that wait is ``IDLE_TIMEOUT``; such a rank is owned by rank 0 (a
daemon process, an actor of the replica) and goes with it. A peer that dies closes its
sockets and fails the wait at once; ``abort()`` closes this rank's, so that its peers
fail at once too. A rank whose op failed must ``abort()``: the ranks no longer agree on
which op comes next.

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

PEER_TIMEOUT_S = 300.0  # the default bound on every wait for a peer
IDLE_TIMEOUT = timedelta(days=30)  # ranks 1..N-1 waiting for rank 0's next message


class Comm(Protocol):
    """What the sharded layers need: their rank and an in-place sum over the group."""

    rank: int
    world_size: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of one TP group meet (rank 0's TCPStore), and how long any rank
    waits for a peer (it travels to every rank, so all use the same bound)."""

    host: str
    port: int
    world_size: int
    timeout_s: float = PEER_TIMEOUT_S


def open_rendezvous(host: str, world_size: int, timeout_s: float | None = None) -> tuple[dist.TCPStore, Rendezvous]:
    """Rank 0: host the store on a free port of ``host``; hand the Rendezvous to the others.
    ``timeout_s`` (default ``PEER_TIMEOUT_S``) bounds every wait on a peer, see the module."""
    timeout_s = PEER_TIMEOUT_S if timeout_s is None else timeout_s
    if timeout_s <= 0:
        raise ValueError(f"tensor-parallel peer timeout must be positive, got {timeout_s}")
    store = dist.TCPStore(
        host, 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )
    return store, Rendezvous(host, store.port, world_size, timeout_s)


def joined_key(rank: int) -> str:
    return f"hybridserve/joined/{rank}"


def wait_joined(store: dist.TCPStore, rendezvous: Rendezvous, alive: Any = None) -> None:
    """Rank 0: wait until every other rank has reached the store, at most ``timeout_s``.

    ``alive()`` is polled meanwhile and should raise when a rank has failed (its launcher
    knows how), so a worker that dies while starting fails rank 0 at once instead of
    after the timeout.
    """
    keys = [joined_key(r) for r in range(1, rendezvous.world_size)]
    deadline = time.monotonic() + rendezvous.timeout_s
    while not store.check(keys):
        if alive is not None:
            alive()
        if time.monotonic() > deadline:
            missing = [r for r in range(1, rendezvous.world_size) if not store.check([joined_key(r)])]
            raise TimeoutError(f"tensor-parallel ranks {missing} did not join within {rendezvous.timeout_s:g}s")
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
    """One rank's membership of a TP group (see the module docstring for the waits).

    ``timeout`` bounds each control op of this rank (the rendezvous's bound; a plain
    attribute, so a test may shorten it after the connect); the model group's bound is
    fixed at the connect. After ``abort()`` every op raises ``RuntimeError`` naming the
    reason; ``closed`` says so. No method keeps a group in a local variable: a failed
    op's traceback would keep it, and its sockets, alive past ``abort()``.
    """

    def __init__(
        self, rendezvous: Rendezvous, rank: int, device: torch.device, store: dist.TCPStore | None = None
    ) -> None:
        if not 0 <= rank < rendezvous.world_size:
            raise ValueError(f"rank {rank} is outside world size {rendezvous.world_size}")
        self.rank, self.world_size, self.device = rank, rendezvous.world_size, device
        self.timeout = timedelta(seconds=rendezvous.timeout_s)
        self.closed_reason: str | None = None
        self._model: Any = None
        self._control: Any = None
        if store is None:
            store = dist.TCPStore(
                rendezvous.host, rendezvous.port, rendezvous.world_size, is_master=False, timeout=self.timeout
            )
        if rank:
            store.set(joined_key(rank), "1")
        self._store: dist.TCPStore | None = store
        try:
            self._connect(rendezvous.host)
        except RuntimeError as exc:
            self.abort(f"its connect failed: {exc}")
            raise RuntimeError(
                f"tensor-parallel rank {rank} of {self.world_size} could not connect to its "
                f"peers at {rendezvous.host}:{rendezvous.port} within "
                f"{rendezvous.timeout_s:g}s (a rank died or stalled while starting): "
                f"{exc}"
            ) from exc

    def _connect(self, host: str) -> None:
        assert self._store is not None
        rank, size = self.rank, self.world_size
        if self.device.type == "cuda":
            index = self.device.index
            torch.cuda.set_device(index if index is not None else torch.cuda.current_device())
            self._model = _nccl(dist.PrefixStore("model", self._store), rank, size, self.timeout)
        else:
            self._model = _gloo(dist.PrefixStore("model", self._store), rank, size, host, self.timeout)
        self._control = _gloo(dist.PrefixStore("control", self._store), rank, size, host, self.timeout)

    @property
    def closed(self) -> bool:
        return self.closed_reason is not None

    def _groups(self) -> tuple[Any, Any]:
        if self._model is None or self._control is None:
            raise RuntimeError(f"tensor-parallel group of rank {self.rank} is closed: {self.closed_reason}")
        return self._model, self._control

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` (contiguous) over the group, in place; every rank gets the same bits."""
        self._groups()[0].allreduce([tensor]).wait()
        return tensor

    def check_same(self, value: int, what: str) -> None:
        """Raise on every rank unless all ranks passed the same ``value`` (a debug check)."""
        t = torch.tensor([value, -value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        opts.timeout = self.timeout
        self._groups()[1].allreduce([t], opts).wait()
        if int(t[0]) != value or int(t[1]) != -value:
            raise RuntimeError(
                f"tensor-parallel ranks diverged: {what} differs between ranks (rank {self.rank} has {value:#x})"
            )

    def broadcast_bytes(self, payload: bytes | None, idle: bool = False) -> bytes:
        """Rank 0 sends ``payload``; every rank returns it (two gloo broadcasts).

        ``idle`` (ranks 1..N-1): wait for rank 0's next message up to ``IDLE_TIMEOUT``
        rather than ``timeout``; rank 0's send is bounded by ``timeout`` either way."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = IDLE_TIMEOUT if idle and self.rank else self.timeout
        size = torch.tensor([len(payload) if self.rank == 0 and payload is not None else 0], dtype=torch.int64)
        self._groups()[1].broadcast([size], opts).wait()
        opts.timeout = self.timeout
        if self.rank == 0:
            assert payload is not None
            buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        else:
            buf = torch.empty(int(size[0]), dtype=torch.uint8)
        self._groups()[1].broadcast([buf], opts).wait()
        return payload if self.rank == 0 and payload is not None else buf.numpy().tobytes()

    def broadcast_object(self, obj: Any = None, idle: bool = False) -> Any:
        """Rank 0's ``obj`` on every rank (pickled; only ever between ranks of one group)."""
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == 0 else None
        return pickle.loads(self.broadcast_bytes(payload, idle))

    def abort(self, reason: str = "aborted") -> None:
        """Close this rank's connections so that peers blocked on it fail now, not at a
        timeout; later ops raise naming ``reason``. Safe to call twice.

        Gloo's ``abort()`` leaves the sockets open (torch 2.13); freeing the group closes
        them. Its destructor joins the group's threads, so call this when no op of this
        rank is in flight (every caller does: after its op failed, or at shutdown).
        """
        if self.closed_reason is None:
            self.closed_reason = reason
        model, self._model, self._control, self._store = self._model, None, None, None
        if model is not None and self.device.type == "cuda":
            try:
                model.abort()  # NCCL: ends kernels still waiting on a dead peer
            except Exception:  # noqa: BLE001 - best effort while failing
                pass
