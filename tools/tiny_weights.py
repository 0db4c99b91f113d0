"""Random weights for the tiny checkpoints: the redraw rules and the MTP tensor writers.

``redraw_`` re-draws one HF tensor in place: matrices with std 1/sqrt(fan_in) (so greedy
output does not collapse), recurrent decay parameters in the range real models use, norm
weights near 1 (near 0 for zero-centred ``1 + w`` norms), everything else (biases, the MoE
score-correction bias) small. ``redraw_model_`` applies it to every parameter, then every
persistent buffer a checkpoint saves, in a fixed order.

MTP writers add ``mtp.*`` tensors that transformers itself neither creates nor loads, laid
out as the released checkpoints are (``add_qwen_mtp``, ``add_nemotron_mtp``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# A family's own rule for some tensors: (HF name, tensor, generator) -> True if it re-drew it.
RedrawRule = Callable[[str, torch.Tensor, torch.Generator], bool]


def redraw_(name: str, p: torch.Tensor, gen: torch.Generator, zero_centered_norms: bool) -> None:
    """Re-draw one HF tensor in place (see the module docstring); drawn on ``p``'s device, so
    ``gen`` must live there too (the GPU bench draws a 1B model on the GPU)."""

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32, device=p.device)

    def rand(shape: torch.Size) -> torch.Tensor:
        return torch.rand(shape, generator=gen, device=p.device)

    if p.dim() >= 2:
        p.copy_(randn(*p.shape) / math.sqrt(p.shape[-1]))
    elif name.endswith("A_log"):  # A in [1, 16], as in Mamba / GDN inits
        p.copy_(torch.log(1.0 + 15.0 * rand(p.shape)))
    elif name.endswith("dt_bias"):  # softplus(dt_bias) log-uniform in [1e-3, 1e-1]
        dt = torch.exp(math.log(1e-3) + (math.log(1e-1) - math.log(1e-3)) * rand(p.shape))
        p.copy_(dt + torch.log(-torch.expm1(-dt)))
    elif name.endswith(".D"):
        p.copy_(1.0 + 0.1 * randn(*p.shape))
    elif name.endswith(".weight") and "norm" in name.split(".")[-2]:
        plain = not zero_centered_norms or name.endswith("linear_attn.norm.weight")
        p.copy_((1.0 if plain else 0.0) + 0.1 * randn(*p.shape))
    else:  # biases, score-correction biases
        p.copy_(0.1 * randn(*p.shape))


def redraw_mamba1(name: str, p: torch.Tensor, gen: torch.Generator) -> bool:
    """Mamba1 (Jamba, Mamba, Zamba): ``A_log`` is [d_inner, N] (the generic rule would draw it
    as a matrix) and ``dt_proj.bias`` is the dt bias; both drawn as the Mamba2 ones are. Zamba's
    per-head ``dt_proj_bias`` [heads, P] and ``D`` [heads, P] are drawn as the 1-D ones."""
    if name.endswith("A_log"):
        p.copy_(torch.log(1.0 + 15.0 * torch.rand(p.shape, generator=gen, device=p.device)))
        return True
    if name.endswith(("dt_proj.bias", "dt_proj_bias")):
        redraw_(name.replace("dt_proj.bias", "dt_bias").replace("dt_proj_bias", "dt_bias"), p.view(-1), gen, False)
        return True
    if name.endswith(".D") and p.dim() > 1:
        redraw_(name, p.view(-1), gen, zero_centered_norms=False)
        return True
    return False


def redraw_model_(model: torch.nn.Module, seed: int, zero_centered_norms: bool, rule: RedrawRule | None = None) -> None:
    """Every parameter (named_parameters order), then every saved buffer, re-drawn from
    ``seed``; ``rule`` (a family's own) is asked first for each tensor."""
    gen = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    saved = model.state_dict(keep_vars=True)
    buffers = [(n, b) for n, b in model.named_buffers() if n in saved and n not in params and b.is_floating_point()]
    with torch.no_grad():
        for name, t in [*params.items(), *buffers]:
            if rule is None or not rule(name, t, gen):
                redraw_(name, t, gen, zero_centered_norms)


def redraw_decay_logs(name: str, p: torch.Tensor, gen: torch.Generator) -> bool:
    """Any-shaped ``A_log`` (Kimi-Linear stores [1, 1, H, 1]) as the generic 1-D rule draws it."""
    if not name.endswith("A_log"):
        return False
    p.copy_(torch.log(1.0 + 15.0 * torch.rand(p.shape, generator=gen, device=p.device)))
    return True


def redraw_global_scales(name: str, p: torch.Tensor, gen: torch.Generator) -> bool:
    """Learned scalar output scales (Inkling's ``global_scale``) near 1, as trained ones are."""
    if not name.endswith("global_scale"):
        return False
    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen, device=p.device))
    return True


def redraw_inkling2(name: str, p: torch.Tensor, gen: torch.Generator) -> bool:
    """Inkling2's learned per-head scales before its L2 clips near 1, as trained ones are (its
    depth-attention queries keep the generic small draw: larger ones make the 15 layer
    invocations of the tiny loop model amplify fp32 rounding past the 1e-4 logits tolerance)."""
    if not name.endswith("norm.scale"):
        return False
    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen, device=p.device))
    return True


def redraw_rglru(name: str, p: torch.Tensor, gen: torch.Generator) -> bool:
    """RecurrentGemma's ``recurrent_param`` as transformers initialises it: softplus of it
    = -log(u) / 2 with u uniform in [0.81, 0.998] (a decay a^8 in [0.9, 0.999] at a closed gate)."""
    if not name.endswith("rg_lru.recurrent_param"):
        return False
    u = 0.81 + (0.998 - 0.81) * torch.rand(p.shape, generator=gen, device=p.device)
    p.copy_(torch.log(torch.expm1(-0.5 * torch.log(u))))
    return True


def redraw_zaya(name: str, p: torch.Tensor, gen: torch.Generator) -> bool:
    """ZAYA's learned multiplicative scales (residual, input, router-state) near 1, as trained
    ones are (the generic rule would draw them near 0); the residual stream's biases small (16
    of them at 0.1 would swamp the 1/sqrt(H) embeddings); the key scale ``qk_norm.temp`` (the
    logits' temperature: q and k are L2-normed) near 4, so attention is sharp enough that 32
    greedy tokens do not fall into short loops (near 1 they do)."""
    if name.endswith("qk_norm.temp"):
        p.copy_(4.0 + 1.0 * torch.randn(p.shape, generator=gen, device=p.device))
    elif name.endswith("_scale"):
        p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen, device=p.device))
    elif name.endswith(("hidden_states_bias", "residual_bias")):
        p.copy_(0.01 * torch.randn(p.shape, generator=gen, device=p.device))
    else:
        return False
    return True


def redraw_glm5_next(name: str, p: torch.Tensor, gen: torch.Generator) -> bool:
    """GLM-5.3-Flash's mHC scales (``attn_hc.scale`` / ``ffn_hc.scale``) near 1, as initialised
    (the generic rule would draw them near 0, leaving the stream weights almost constant)."""
    if not name.endswith("_hc.scale"):
        return False
    p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen, device=p.device))
    return True


def keep_lightning_buffers(name: str, p: torch.Tensor, gen: torch.Generator) -> bool:
    """MiniMax's saved decay buffers stay as transformers computed them (they are a function of
    the layer index, not weights)."""
    return name.endswith(("slope_rate", "query_decay", "key_decay", "diagonal_decay"))


def add_qwen_mtp(out_dir: Path, cfg: Any, seed: int) -> None:
    """Add random Qwen3-Next / Qwen3.5 ``mtp.*`` tensors to the last safetensors file (and the
    index).

    Layout as in the released checkpoints (read by vLLM's Qwen3NextMTP / Qwen3_5MTP): ``fc``
    [H, 2H], ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``norm`` [H], and
    ``layers.{j}.*`` for j < ``mtp_num_hidden_layers`` (1 when the config has none), each
    shaped like a full-attention decoder layer of the main model (not an ``mlp_only`` one, so
    MoE where the model has experts). A VL config's language model is its ``text_config``,
    whose tensors live under ``model.language_model.``.
    """
    text = getattr(cfg, "text_config", None) or cfg
    prefix = "model." if text is cfg else "model.language_model."
    dense = getattr(text, "mlp_only_layers", None) or []
    full = [i for i, kind in enumerate(text.layer_types) if kind == "full_attention" and i not in dense]
    if not full:
        raise ValueError("mtp=True needs a full-attention layer to copy the shape of")
    n = getattr(text, "mtp_num_hidden_layers", None)
    shapes: dict[str, tuple[int, ...]] = {}
    for j in range(1 if n is None else n):
        shapes.update(tensor_shapes(out_dir, f"{prefix}layers.{full[0]}.", f"mtp.layers.{j}."))
    h = text.hidden_size
    shapes.update(
        {
            "mtp.fc.weight": (h, 2 * h),
            "mtp.pre_fc_norm_embedding.weight": (h,),
            "mtp.pre_fc_norm_hidden.weight": (h,),
            "mtp.norm.weight": (h,),
        }
    )
    append_tensors(out_dir, random_tensors(shapes, seed + 1, zero_centered_norms=True))


def add_nemotron_mtp(out_dir: Path, cfg: Any, seed: int) -> None:
    """Add random Nemotron-H ``mtp.*`` tensors (``num_nextn_predict_layers`` MTP layers of
    ``mtp_layers_block_type``) to the last safetensors file (and the index).

    Layout as released (read by vLLM's / SGLang's Nemotron-H MTP): block b of MTP layer m is
    ``mtp.layers.{m * L + b}.*``, shaped like the first backbone block of its kind; the first
    block of each MTP layer adds ``enorm`` / ``hnorm`` [H] and ``eh_proj`` [H, 2H], the last
    one ``final_layernorm`` [H].
    """
    if cfg.num_nextn_predict_layers < 1:
        raise ValueError(
            f"mtp=True needs num_nextn_predict_layers >= 1 in the config, not {cfg.num_nextn_predict_layers}"
        )
    kinds = list(cfg.mtp_layers_block_type)
    backbone = list(cfg.layers_block_type)
    missing = sorted(set(kinds) - set(backbone))
    if missing:
        raise ValueError(f"mtp=True needs a backbone block of every MTP kind; missing {missing}")
    h = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {}
    for m in range(cfg.num_nextn_predict_layers):
        for b, kind in enumerate(kinds):
            dst = f"mtp.layers.{m * len(kinds) + b}."
            shapes.update(tensor_shapes(out_dir, f"backbone.layers.{backbone.index(kind)}.", dst))
            if b == 0:
                shapes.update(
                    {dst + "enorm.weight": (h,), dst + "hnorm.weight": (h,), dst + "eh_proj.weight": (h, 2 * h)}
                )
            if b == len(kinds) - 1:
                shapes[dst + "final_layernorm.weight"] = (h,)
    append_tensors(out_dir, random_tensors(shapes, seed + 1, zero_centered_norms=False))


def tensor_shapes(out_dir: Path, src_prefix: str, dst_prefix: str) -> dict[str, tuple[int, ...]]:
    """Shapes of the checkpoint's tensors under ``src_prefix``, renamed to ``dst_prefix``."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for name in _shard_files(out_dir):
        with safe_open(str(out_dir / name), "pt") as f:
            for key in f.keys():
                if key.startswith(src_prefix):
                    shapes[dst_prefix + key[len(src_prefix) :]] = tuple(f.get_slice(key).get_shape())
    return shapes


def random_tensors(shapes: dict[str, tuple[int, ...]], seed: int, zero_centered_norms: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(shapes.items()):
        t = torch.empty(shape, dtype=torch.float32)
        redraw_(name, t, gen, zero_centered_norms)
        out[name] = t
    return out


def append_tensors(out_dir: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Add ``tensors`` to the last safetensors file of ``out_dir`` (and to its index)."""
    from safetensors.torch import load_file, save_file

    index_path = out_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    last = _shard_files(out_dir)[-1]
    existing = load_file(str(out_dir / last))
    save_file({**existing, **tensors}, str(out_dir / last), metadata={"format": "pt"})
    if index is not None:
        index["weight_map"].update({name: last for name in tensors})
        index["weight_map"] = dict(sorted(index["weight_map"].items()))
        added = sum(t.numel() * t.element_size() for t in tensors.values())
        index.setdefault("metadata", {})["total_size"] = index["metadata"].get("total_size", 0) + added
        index_path.write_text(json.dumps(index, indent=2) + "\n")


def _shard_files(out_dir: Path) -> list[str]:
    index_path = out_dir / "model.safetensors.index.json"
    if index_path.exists():
        return sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
    return ["model.safetensors"]
