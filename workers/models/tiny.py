"""Tiny random-weight checkpoints and a tiny tokenizer, for tests and the placeholder model.

- ``build_tiny_tokenizer(out_dir)``: byte-level BPE (vocab 512) trained deterministically on a
  fixed text held in this file; specials ``<|endoftext|>`` (eos and pad), ``<|im_start|>``,
  ``<|im_end|>``; a ChatML chat template. Loads offline with ``AutoTokenizer``.
- ``make_tiny_checkpoint(arch, out_dir, ...)``: a transformers model of the family with a
  tiny config, every weight re-drawn (matrices with std 1/sqrt(fan_in), so greedy output
  does not collapse; recurrent decay parameters in the range real models use), saved as HF
  safetensors (optionally sharded) next to the tokenizer. ``mtp=True`` (Qwen3-Next) adds
  random ``mtp.*`` tensors, which transformers itself neither creates nor loads.

Regenerate the shipped placeholder with ``python -m workers.models.tiny --out configs/models/tiny-hybrid``.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch

from workers.models.tiny_text import EOS_TOKEN, SPECIAL_TOKENS, TRAINING_TEXT, write_tokenizer_config

TOKENIZER_VOCAB = 512
ARCHS = ("qwen3_next", "granitemoehybrid")


def build_tiny_tokenizer(out_dir: str | Path) -> int:
    """Train and save the tokenizer into ``out_dir``; returns its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  min_frequency=1, show_progress=False)
    tok.train_from_iterator(TRAINING_TEXT.splitlines(keepends=True), trainer)
    tok.save(str(out / "tokenizer.json"))
    write_tokenizer_config(out)
    return tok.get_vocab_size()


def tiny_config(arch: str, vocab_size: int, eos_id: int, **overrides: Any) -> Any:
    """The transformers config of a tiny model (hidden 64, 5 layers, 2 of them attention)."""
    common = dict(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=5,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                  eos_token_id=eos_id, pad_token_id=eos_id, bos_token_id=None)
    if arch == "qwen3_next":
        from transformers import Qwen3NextConfig
        kw = dict(common, head_dim=32, intermediate_size=128,
                  layer_types=["linear_attention", "full_attention", "linear_attention",
                               "linear_attention", "full_attention"],
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                  linear_value_head_dim=16, linear_conv_kernel_dim=4,
                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=32, decoder_sparse_step=1,
                  mlp_only_layers=[0], tie_word_embeddings=False)
        return Qwen3NextConfig(**{**kw, **overrides})
    if arch == "granitemoehybrid":
        from transformers import GraniteMoeHybridConfig
        kw = dict(common, intermediate_size=32, shared_intermediate_size=64,
                  layer_types=["mamba", "attention", "mamba", "mamba", "attention"],
                  num_local_experts=4, num_experts_per_tok=2, mamba_n_heads=8, mamba_d_head=16,
                  mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4, mamba_expand=2,
                  mamba_chunk_size=16, position_embedding_type="rope",
                  embedding_multiplier=1.0, residual_multiplier=0.5,
                  attention_multiplier=0.125, logits_scaling=2.0, tie_word_embeddings=False)
        return GraniteMoeHybridConfig(**{**kw, **overrides})
    raise ValueError(f"unknown tiny arch {arch!r}; expected one of {ARCHS}")


def redraw_(name: str, p: torch.Tensor, gen: torch.Generator, zero_centered_norms: bool) -> None:
    """Re-draw one HF-named parameter in place (see the module docstring); drawn on ``p``'s
    device, so ``gen`` must live there too (the GPU bench draws a 1B model on the GPU)."""
    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32, device=p.device)

    def rand(shape: torch.Size) -> torch.Tensor:
        return torch.rand(shape, generator=gen, device=p.device)

    if p.dim() >= 2:
        p.copy_(randn(*p.shape) / math.sqrt(p.shape[-1]))
    elif name.endswith("A_log"):            # A in [1, 16], as in Mamba / GDN inits
        p.copy_(torch.log(1.0 + 15.0 * rand(p.shape)))
    elif name.endswith("dt_bias"):          # softplus(dt_bias) log-uniform in [1e-3, 1e-1]
        dt = torch.exp(math.log(1e-3) + (math.log(1e-1) - math.log(1e-3))
                       * rand(p.shape))
        p.copy_(dt + torch.log(-torch.expm1(-dt)))
    elif name.endswith(".D"):
        p.copy_(1.0 + 0.1 * randn(*p.shape))
    elif name.endswith(".weight") and "norm" in name.split(".")[-2]:
        plain = not zero_centered_norms or name.endswith("linear_attn.norm.weight")
        p.copy_((1.0 if plain else 0.0) + 0.1 * randn(*p.shape))
    else:                                   # biases
        p.copy_(0.1 * randn(*p.shape))


def _hf_model(arch: str, cfg: Any, seed: int) -> torch.nn.Module:
    from transformers import GraniteMoeHybridForCausalLM, Qwen3NextForCausalLM

    cls = Qwen3NextForCausalLM if arch == "qwen3_next" else GraniteMoeHybridForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            redraw_(name, p, gen, zero_centered_norms=(arch == "qwen3_next"))
    return model.eval()


def make_tiny_checkpoint(arch: str, out_dir: str | Path, *, seed: int = 0, shards: int = 1,
                         mtp: bool = False, **config_overrides: Any) -> Path:
    """Write a tiny random checkpoint of ``arch`` (+ tokenizer) into ``out_dir``; returns it."""
    if arch not in ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; expected one of {ARCHS}")
    if mtp and arch != "qwen3_next":
        raise ValueError("mtp=True is only defined for qwen3_next")
    out = Path(out_dir)
    vocab = build_tiny_tokenizer(out)
    cfg = tiny_config(arch, vocab, SPECIAL_TOKENS.index(EOS_TOKEN), **config_overrides)
    model = _hf_model(arch, cfg, seed)
    total = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    max_shard = total if shards <= 1 else total // shards + 1
    _save_quietly(model, out, max(max_shard, 1))
    if mtp:
        add_mtp_tensors(out, cfg, seed)
    for path in out.glob("*.safetensors"):
        path.chmod(0o644)           # save_pretrained writes 0600; the files are not secret
    return out


def add_mtp_tensors(out_dir: Path, cfg: Any, seed: int) -> None:
    """Add random Qwen3-Next ``mtp.*`` tensors to the last safetensors file (and the index).

    Layout as in the released checkpoints (read by vLLM's Qwen3NextMTP): ``fc`` [H, 2H],
    ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``norm`` [H], and ``layers.0.*`` shaped
    like a full-attention MoE decoder layer of the main model.
    """
    from safetensors.torch import load_file, save_file

    index_path = out_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    files = sorted(set(index["weight_map"].values())) if index else ["model.safetensors"]
    last = files[-1]
    tensors = load_file(str(out_dir / last))
    mtp = _mtp_tensors(out_dir, files, cfg, seed)
    save_file({**tensors, **mtp}, str(out_dir / last), metadata={"format": "pt"})
    if index is not None:
        index["weight_map"].update({name: last for name in mtp})
        index["weight_map"] = dict(sorted(index["weight_map"].items()))
        added = sum(t.numel() * t.element_size() for t in mtp.values())
        index.setdefault("metadata", {})["total_size"] = index["metadata"].get("total_size", 0) + added
        index_path.write_text(json.dumps(index, indent=2) + "\n")


def _mtp_tensors(out_dir: Path, files: list[str], cfg: Any, seed: int) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    full = [i for i, kind in enumerate(cfg.layer_types) if kind == "full_attention"
            and i not in cfg.mlp_only_layers and cfg.num_experts > 0]
    if not full:
        raise ValueError("mtp=True needs a full-attention MoE layer to copy the shape of")
    src = f"model.layers.{full[0]}."
    shapes: dict[str, tuple[int, ...]] = {}
    for name in files:
        with safe_open(str(out_dir / name), "pt") as f:
            for key in f.keys():
                if key.startswith(src):
                    shapes["mtp.layers.0." + key[len(src):]] = tuple(f.get_slice(key).get_shape())
    h = cfg.hidden_size
    shapes.update({"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
                   "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,)})
    gen = torch.Generator().manual_seed(seed + 1)
    out = {}
    for name, shape in sorted(shapes.items()):
        t = torch.empty(shape, dtype=torch.float32)
        redraw_(name, t, gen, zero_centered_norms=True)
        out[name] = t
    return out


def _save_quietly(model: torch.nn.Module, out: Path, max_shard_size: int) -> None:
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out, max_shard_size=max_shard_size)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--arch", default="qwen3_next", choices=ARCHS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shards", type=int, default=1)
    args = parser.parse_args(argv)
    out = make_tiny_checkpoint(args.arch, args.out, seed=args.seed, shards=args.shards,
                               mtp=args.arch == "qwen3_next")
    (out / "README.md").write_text(
        f"# tiny-hybrid\n\nRandom-weight placeholder model ({args.arch}, seed {args.seed}), "
        "not trained: it generates gibberish. Regenerate with\n"
        f"`python -m workers.models.tiny --out {args.out}`.\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
