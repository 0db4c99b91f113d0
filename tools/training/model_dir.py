"""The shipped model's directory: saved (HF config and safetensors, with the MTP head's
tensors beside the model's) and loaded back for the numbers its README reports."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tools.training.mtp_head import TrainableMtpHead


def save_model_dir(out_dir: Path, model, mtp: TrainableMtpHead, save_dtype: str) -> None:
    """config.json + model.safetensors (``model.*`` from save_pretrained, plus ``mtp.*``)."""
    from safetensors.torch import load_file, save_file
    from transformers.utils import logging as hf_logging

    dtype = getattr(torch, save_dtype)
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out_dir)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
    path = out_dir / "model.safetensors"
    tensors = {k: v.to(dtype).contiguous() for k, v in load_file(str(path)).items()}
    tensors.update(mtp.checkpoint_tensors(dtype))
    save_file(dict(sorted(tensors.items())), str(path), metadata={"format": "pt"})
    path.chmod(0o644)
    cfg_path = out_dir / "config.json"
    raw = json.loads(cfg_path.read_text())
    raw["dtype"] = save_dtype
    cfg_path.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")


def load_saved(out_dir: Path):
    """Reload a saved dir into (HF model, TrainableMtpHead) in float32 (for the reported numbers)."""
    from safetensors.torch import load_file
    from transformers import Qwen3NextForCausalLM

    model = Qwen3NextForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32)
    mtp = TrainableMtpHead(model.config)
    tensors = load_file(str(out_dir / "model.safetensors"))
    expected = mtp.checkpoint_tensors()
    state = {}
    for name, t in mtp.state_dict().items():
        if name.startswith("rotary_emb."):
            state[name] = t
        elif name.endswith("mlp.experts.gate_up_proj"):
            base = "mtp." + name[: -len("gate_up_proj")]
            state[name] = torch.stack(
                [
                    torch.cat([tensors[f"{base}{e}.gate_proj.weight"], tensors[f"{base}{e}.up_proj.weight"]])
                    for e in range(t.shape[0])
                ]
            )
        elif name.endswith("mlp.experts.down_proj"):
            base = "mtp." + name[: -len("down_proj")]
            state[name] = torch.stack([tensors[f"{base}{e}.down_proj.weight"] for e in range(t.shape[0])])
        else:
            state[name] = tensors["mtp." + name]
    missing = set(expected) - {k for k in tensors if k.startswith("mtp.")}
    if missing:
        raise ValueError(f"saved dir lacks MTP tensors {sorted(missing)}")
    mtp.load_state_dict({k: v.float() for k, v in state.items()})
    return model.eval(), mtp.eval()
