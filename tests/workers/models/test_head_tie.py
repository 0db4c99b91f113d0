"""Every family against transformers with the head tie the registry does not use.

The registry builds each family with one ``tie_word_embeddings`` (its config's default or the
registry's choice); these tests flip it, so every family is compared tied and untied. A
tying class drops ``lm_head.weight`` from a tied checkpoint (the loader must not require it)
and reads its own ``lm_head.weight`` untied (the loader must use it); Zamba2 also shares its
attention blocks only when tied. Cheap on purpose: prefill and one decode, no engine.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import FAMILIES
from tests.workers.models.hf_oracle import HFOracle
from tests.workers.models.test_vs_transformers import check_prefill_and_one_decode

PROMPT_LENGTHS = [4, 21]  # one prompt crosses the SSD chunk (16)


def registry_ties(name: str) -> bool:
    """The tie the registry's checkpoint of ``name`` has (a VL config's is top-level)."""
    from tools.tiny import tiny_config

    return bool(tiny_config(name, 512, 0).tie_word_embeddings)


@pytest.mark.parametrize("name", FAMILIES)
def test_other_head_tie_matches_transformers(name: str, tmp_path) -> None:
    from tools.tiny import make_tiny_checkpoint
    from workers.loader import load_model

    tie = not registry_ties(name)
    ckpt = make_tiny_checkpoint(name, tmp_path, seed=3, tie_word_embeddings=tie)
    model, oracle = load_model(ckpt, torch.float32, "cpu").model, HFOracle(ckpt)
    assert bool(oracle.model.config.tie_word_embeddings) == tie
    check_prefill_and_one_decode(model, oracle, PROMPT_LENGTHS, seed=4)


def test_untied_zamba2_requires_every_block_copy(tmp_path) -> None:
    """Untied, a hybrid layer that reuses a block runs its own copy: the copy is required."""
    from safetensors.torch import load_file, save_file

    from tools.tiny import make_tiny_checkpoint
    from tools.tiny_registry import get_family
    from workers.loader import load_model

    ckpt = make_tiny_checkpoint("zamba2", tmp_path, seed=3, tie_word_embeddings=False)
    hybrid = [i for i, k in enumerate(get_family("zamba2").config["layers_block_type"]) if k == "hybrid"]
    reuse = f"model.layers.{hybrid[2]}.shared_transformer."  # block 0's second invocation
    tensors = load_file(str(ckpt / "model.safetensors"))
    save_file(
        {n: t for n, t in tensors.items() if not n.startswith(reuse)},
        str(ckpt / "model.safetensors"),
        metadata={"format": "pt"},
    )
    with pytest.raises(ValueError, match=f"missing .*{reuse}"):
        load_model(ckpt, torch.float32, "cpu")


def _retie(ckpt, edit) -> None:
    """Rewrite the checkpoint's tensors by ``edit(dict)``."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(ckpt / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("form", ["lm_head_equal", "lm_head_only"])
def test_tied_checkpoint_that_carries_its_head_matches_transformers(form: str, tmp_path) -> None:
    """A tied config whose checkpoint has ``lm_head.weight`` too (equal), or only it: transformers
    ties them to the one tensor there is, and so do we."""
    from tools.tiny import make_tiny_checkpoint
    from workers.loader import load_model

    ckpt = make_tiny_checkpoint("granitemoehybrid", tmp_path, seed=3, tie_word_embeddings=True)
    embed = "model.embed_tokens.weight"

    def edit(tensors: dict) -> None:
        tensors["lm_head.weight"] = tensors[embed].clone()
        if form == "lm_head_only":
            del tensors[embed]

    _retie(ckpt, edit)
    model, oracle = load_model(ckpt, torch.float32, "cpu").model, HFOracle(ckpt)
    check_prefill_and_one_decode(model, oracle, PROMPT_LENGTHS, seed=4)


@pytest.mark.parametrize("arch", ["granitemoehybrid", "zamba2"])
def test_tied_tensors_that_differ_are_refused(arch: str, tmp_path) -> None:
    """transformers unties tied tensors that differ in the checkpoint; a tied model here cannot,
    so it refuses, naming both (no silent choice of one)."""
    from tools.tiny import make_tiny_checkpoint
    from workers.loader import load_model

    ckpt = make_tiny_checkpoint(arch, tmp_path, seed=3, tie_word_embeddings=True)
    if arch == "zamba2":  # block 0 repeated under its second user, one value changed
        hybrid = [
            i
            for i, k in enumerate(json.loads((ckpt / "config.json").read_text())["layers_block_type"])
            if k == "hybrid"
        ]
        owner = f"model.layers.{hybrid[0]}.shared_transformer.pre_ff_layernorm.weight"
        alias = owner.replace(f"layers.{hybrid[0]}.", f"layers.{hybrid[2]}.")
    else:
        owner, alias = "model.embed_tokens.weight", "lm_head.weight"

    def edit(tensors: dict) -> None:
        tensors[alias] = tensors[owner].clone()
        tensors[alias][0] += 1.0

    _retie(ckpt, edit)
    with pytest.raises(ValueError, match=f"{owner}.*{alias}.*different values"):
        load_model(ckpt, torch.float32, "cpu")
