"""When a device checkpoint is copied to the host tier for the cluster store (pure rules).

``cache.store_write_policy`` (the names of SGLang's HiCache write policies; the copies
are ours: device -> host tier -> commit by the replica's publisher):

- ``write_back``: a checkpoint reaches the store when device eviction demotes it, or when
  a prompt hits it on the device (a shared prefix: other replicas want it too). A
  replica's hot checkpoints -- running requests' -- die with it.
- ``write_through``: also every checkpoint the device tree publishes, at once (prefill,
  decode-grid and finish ones). A stream resumed on another replica finds the deepest
  checkpoint its replica had published; costs the most bytes.
- ``write_through_selective``: also the checkpoints a prefill publishes (prompt depths:
  the last page-aligned prompt position, the track-grid point below it, a branching
  point), the ones a later prompt with the same system prompt or conversation reuses;
  checkpoints inside generated text (decode grid, finish) wait for eviction or a hit.

Only with the store on (``cache.cluster_store_bytes``): without it nothing is committed.
"""

from __future__ import annotations

from typing import Literal

WritePolicyName = Literal["write_back", "write_through", "write_through_selective"]
PUBLISH_PHASES = ("prefill", "decode", "finish")  # hybridserve_mamba_checkpoints_inserted_total{phase}


class WritePolicy:
    def __init__(self, name: WritePolicyName, store_on: bool) -> None:
        if name not in ("write_back", "write_through", "write_through_selective"):
            raise ValueError(f"unknown store write policy {name!r}")
        self.name = name
        self.store_on = store_on

    def on_publish(self, phase: str) -> bool:
        """Whether a checkpoint the device tree just published is copied to the host now."""
        if phase not in PUBLISH_PHASES:
            raise ValueError(f"unknown publish phase {phase!r}")
        if not self.store_on or self.name == "write_back":
            return False
        return self.name == "write_through" or phase == "prefill"

    def on_hit(self) -> bool:
        """Whether a device checkpoint a prompt hit is copied (every policy, store on)."""
        return self.store_on
