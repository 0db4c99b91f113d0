"""Tensor parallelism inside one TP group (DESIGN §1.1): SPMD over sharded models.

Every rank runs the same step on its own model shard and pool shard; row-parallel
all-reduces make hidden states, logits and therefore every decision identical across
ranks. ``shard`` transforms a loaded model; ``comm`` is the process group; ``engine`` is
rank 0 (the engine) and ``worker`` the other ranks; ``local`` launches them as processes.
No Ray here: ``cluster/serving/tp.py`` starts the workers as actors.
"""

from workers.tp.comm import Comm, Rendezvous, TPGroup, open_rendezvous, wait_joined
from workers.tp.shard import shard_model, shard_module, tp_errors, validate_tp

__all__ = [
    "Comm",
    "Rendezvous",
    "TPGroup",
    "open_rendezvous",
    "wait_joined",
    "shard_model",
    "shard_module",
    "tp_errors",
    "validate_tp",
]
