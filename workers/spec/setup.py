"""Building the speculative-decoding pieces from the config (DESIGN §3 ``spec``)."""

from __future__ import annotations

import torch

from configs.schema import HybridServeConfig, SpecConfig
from workers.device_pools import DevicePools
from workers.spec.draft_vocab import load_draft_vocab
from workers.spec.drafter import MtpDrafter


def num_draft_tokens(spec: SpecConfig) -> int:
    return spec.num_draft_tokens if spec.method == "mtp" else 0


def num_mtp_kv_layers(spec: SpecConfig, model: torch.nn.Module) -> int:
    """KV pool layers the drafter needs beyond the target's (the MTP head's attention blocks)."""
    return model.num_mtp_kv_layers if num_draft_tokens(spec) else 0


def build_drafter(
    config: HybridServeConfig,
    model: torch.nn.Module,
    pools: DevicePools,
    mtp_kv_index: int,
    max_model_len: int,
    device: torch.device,
) -> MtpDrafter | None:
    """The drafter over the model's own MTP head (``model.build_mtp_head``) and the tokens it
    scores (``spec.draft_vocab``), or None."""
    k = num_draft_tokens(config.spec)
    if k == 0:
        return None
    mtp = model.build_mtp_head(mtp_kv_index)
    vocab = load_draft_vocab(config.spec.draft_vocab, config.model_dir(), model)
    return MtpDrafter(mtp, model, pools, k, config.cache.page_size, max_model_len, pools.mamba.num_slots, device, vocab)
