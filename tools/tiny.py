"""Tiny random-weight checkpoints and a tiny tokenizer, for tests and the placeholder model.

- ``build_tiny_tokenizer(out_dir)``: byte-level BPE (vocab 512) trained deterministically on a
  fixed text held in this file; specials ``<|endoftext|>`` (eos and pad), ``<|im_start|>``,
  ``<|im_end|>``; a ChatML chat template. Loads offline with ``AutoTokenizer``.
- ``make_tiny_checkpoint(arch, out_dir, ...)``: a transformers model of a registered family
  (``tiny_registry.TINY_FAMILIES``) with its tiny config, every weight re-drawn
  (``tiny_weights``: matrices with std 1/sqrt(fan_in), so greedy output does not collapse;
  recurrent decay parameters in the range real models use), saved as HF safetensors
  (optionally sharded) next to the tokenizer. ``mtp=True`` (families with an MTP writer)
  adds random ``mtp.*`` tensors, which transformers itself neither creates nor loads.

Regenerate the shipped placeholder with ``python -m tools.tiny --out configs/models/tiny-hybrid``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from tools.tiny_registry import TINY_FAMILIES, get_family
from tools.tiny_text import EOS_TOKEN, SPECIAL_TOKENS, TRAINING_TEXT, write_tokenizer_config
from tools.tiny_weights import redraw_, redraw_model_

TOKENIZER_VOCAB = 512
ARCHS = tuple(TINY_FAMILIES)
__all__ = ["ARCHS", "build_tiny_tokenizer", "make_tiny_checkpoint", "redraw_", "tiny_config"]


def build_tiny_tokenizer(out_dir: str | Path) -> int:
    """Train and save the tokenizer into ``out_dir``; returns its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
        show_progress=False,
    )
    tok.train_from_iterator(TRAINING_TEXT.splitlines(keepends=True), trainer)
    tok.save(str(out / "tokenizer.json"))
    write_tokenizer_config(out)
    return tok.get_vocab_size()


def tiny_config(arch: str, vocab_size: int, eos_id: int, **overrides: Any) -> Any:
    """The transformers config of the registered tiny ``arch`` (see ``tiny_registry``)."""
    import transformers

    family = get_family(arch)
    ids = dict(vocab_size=vocab_size, eos_token_id=eos_id, pad_token_id=eos_id, bos_token_id=None)
    cls = getattr(transformers, family.config_class)
    key = family.text_config_key
    if key is None:
        return cls(**{**ids, **family.config, **overrides})
    outer = dict(family.config)
    outer[key] = {**ids, **outer[key], **overrides}
    if "tie_word_embeddings" in overrides:  # a VL checkpoint ties at its top level
        outer["tie_word_embeddings"] = overrides["tie_word_embeddings"]
    return cls(**outer)


def _hf_model(arch: str, cfg: Any, seed: int) -> torch.nn.Module:
    import transformers

    family = get_family(arch)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, family.architecture)(cfg)
    redraw_model_(model, seed, family.zero_centered_norms, family.redraw)
    return model.eval()


def make_tiny_checkpoint(
    arch: str, out_dir: str | Path, *, seed: int = 0, shards: int = 1, mtp: bool = False, **config_overrides: Any
) -> Path:
    """Write a tiny random checkpoint of ``arch`` (+ tokenizer) into ``out_dir``; returns it."""
    family = get_family(arch)
    if mtp and family.mtp_writer is None:
        raise ValueError(
            f"mtp=True: the tiny {arch!r} has no MTP weights; families with mtp: "
            f"{[f.name for f in TINY_FAMILIES.values() if f.has_mtp]}"
        )
    out = Path(out_dir)
    vocab = build_tiny_tokenizer(out)
    cfg = tiny_config(arch, vocab, SPECIAL_TOKENS.index(EOS_TOKEN), **config_overrides)
    model = _hf_model(arch, cfg, seed)
    total = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    max_shard = total if shards <= 1 else total // shards + 1
    _save_quietly(model, out, max(max_shard, 1))
    if mtp:
        assert family.mtp_writer is not None
        family.mtp_writer(out, cfg, seed)
    if family.layout_writer is not None:
        family.layout_writer(out)
    for path in out.glob("*.safetensors"):
        path.chmod(0o644)  # save_pretrained writes 0600; the files are not secret
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
    out = make_tiny_checkpoint(
        args.arch, args.out, seed=args.seed, shards=args.shards, mtp=get_family(args.arch).has_mtp
    )
    (out / "README.md").write_text(
        f"# tiny-hybrid\n\nRandom-weight placeholder model ({args.arch}, seed {args.seed}), "
        "not trained: it generates gibberish. Regenerate with\n"
        f"`python -m tools.tiny --out {args.out}`.\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
