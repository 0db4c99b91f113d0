"""Building the speculative-decoding pieces from the config (DESIGN §3 ``spec``)."""
from __future__ import annotations

import torch

from configs.schema import HybridServeConfig, SpecConfig
from workers.device_pools import DevicePools
from workers.spec.drafter import MtpDrafter


def num_draft_tokens(spec: SpecConfig) -> int:
    if spec.method == "draft":
        raise ValueError("spec.method 'draft' (a separate draft model) is not implemented; "
                         "use 'mtp' (the checkpoint's MTP head) or 'none'")
    return spec.num_draft_tokens if spec.method == "mtp" else 0


def build_drafter(config: HybridServeConfig, model: torch.nn.Module, pools: DevicePools,
                  mtp_kv_index: int, max_model_len: int, device: torch.device) -> MtpDrafter | None:
    k = num_draft_tokens(config.spec)
    if k == 0:
        return None
    from workers.models.mtp import Qwen3NextMTP

    refusal = getattr(model, "mtp_refusal", None)     # a family that has MTP weights we cannot serve
    if refusal:
        raise ValueError(refusal)
    if type(model).__name__ != "Qwen3NextForCausalLM":
        raise ValueError(f"spec.method 'mtp' needs a Qwen3-Next checkpoint with an MTP head; "
                         f"{type(model).__name__} has none")
    mtp = Qwen3NextMTP(model, kv_index=mtp_kv_index)
    return MtpDrafter(mtp, model, pools, k, config.cache.page_size, max_model_len,
                      pools.mamba.num_slots, device)
