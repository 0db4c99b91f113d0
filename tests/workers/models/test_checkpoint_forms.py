"""Checkpoint forms of Kimi-Linear, BailingHybrid, MiniMax and OLMo Hybrid beyond what
``save_pretrained`` writes for the tiny configs: the released q | k | v conv split, MiniMax's
saved decay tables (absent, or disagreeing with the slope), BailingHybrid's MTP layers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.workers.engine.helpers import GREEDY, make_llm
from tests.workers.models.harness import Harness, random_prompts
from tests.workers.models.hf_oracle import HFOracle
from tools.tiny import make_tiny_checkpoint
from tools.tiny_weights import append_tensors, random_tensors, tensor_shapes
from workers.loader import load_model
from workers.models.lightning import decay_tables


def prefill_logits(model_dir: Path) -> list[torch.Tensor]:
    model = load_model(model_dir, torch.float32, "cpu").model
    return Harness(model).prefill(random_prompts(model.config.vocab_size, [5, 23], seed=4))


def rewrite(src: Path, dst: Path, edit) -> Path:
    """A copy of ``src`` whose tensors are ``edit(tensors)``."""
    shutil.copytree(src, dst)
    tensors = edit(load_file(str(dst / "model.safetensors")))
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_olmo_released_conv_split_loads_the_same(tiny_checkpoint, tmp_path) -> None:
    """The tiny OLMo's value width (4 x 24) differs from its key width (4 x 16):
    ``save_pretrained`` splits the merged conv into equal thirds, released checkpoints at
    the widths. Both concatenate to the same conv."""
    src = tiny_checkpoint("olmo_hybrid")
    widths = (64, 64, 96)

    def resplit(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = dict(tensors)
        for name in [n for n in tensors if n.endswith("q_conv1d.weight")]:
            module = name[: -len("q_conv1d.weight")]
            parts = [out.pop(module + f"{p}_conv1d.weight") for p in "qkv"]
            assert [p.shape[0] for p in parts] != list(widths)  # saved in equal thirds
            for p, chunk in zip("qkv", torch.cat(parts).split(widths)):
                out[module + f"{p}_conv1d.weight"] = chunk.clone()
        return out

    released = rewrite(src, tmp_path / "released", resplit)
    for a, b in zip(prefill_logits(src), prefill_logits(released)):
        assert torch.equal(a, b)
    broken = rewrite(
        src, tmp_path / "broken", lambda t: {n: v for n, v in t.items() if not n.endswith("v_conv1d.weight")}
    )
    with pytest.raises(ValueError, match="v_conv1d.weight"):
        load_model(broken, torch.float32, "cpu")


def test_minimax_decay_tables_optional_and_checked(tiny_checkpoint, tmp_path) -> None:
    src = tiny_checkpoint("minimax")
    buffers = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")
    bare = rewrite(src, tmp_path / "bare", lambda t: {n: v for n, v in t.items() if not n.endswith(buffers)})
    for a, b in zip(prefill_logits(src), prefill_logits(bare)):  # the slope from the config
        assert torch.equal(a, b)

    def rescale(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = dict(tensors)
        for name in [n for n in tensors if n.endswith("slope_rate")]:
            module = name[: -len("slope_rate")]
            out[name] = tensors[name] * 1.5
            out.update({module + k: v for k, v in decay_tables(out[name], 16).items()})
        return out

    saved = rewrite(src, tmp_path / "saved", rescale)  # a slope of its own: used as saved
    oracle, prompt = HFOracle(saved), random_prompts(512, [5, 23], seed=4)[1]  # prefill_logits'
    assert (prefill_logits(saved)[1] - oracle.logits(prompt)).abs().max() <= 1e-4
    assert not torch.equal(prefill_logits(saved)[1], prefill_logits(src)[1])

    def corrupt(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        name = "model.layers.2.self_attn.key_decay"
        return {**tensors, name: tensors[name] * 0.9}

    with pytest.raises(ValueError, match=r"model\.layers\.2\.self_attn\.key_decay disagrees"):
        load_model(rewrite(src, tmp_path / "corrupt", corrupt), torch.float32, "cpu")


def test_bailing_mtp_layers_load_but_speculation_is_refused(tmp_path) -> None:
    ckpt = make_tiny_checkpoint("bailing_hybrid", tmp_path, seed=3, num_mtp_layers=1)
    num_layers = json.loads((ckpt / "config.json").read_text())["num_hidden_layers"]
    # an MTP layer after the decoder, shaped like the last (MLA, MoE) layer plus its own norms
    shapes = tensor_shapes(ckpt, f"model.layers.{num_layers - 1}.", f"model.layers.{num_layers}.")
    h = 64
    shapes.update(
        {f"model.layers.{num_layers}.eh_proj.weight": (h, 2 * h), f"model.layers.{num_layers}.enorm.weight": (h,)}
    )
    append_tensors(ckpt, random_tensors(shapes, seed=9, zero_centered_norms=False))
    model = load_model(ckpt, torch.float32, "cpu").model
    assert len(model.mtp_weights) == len(shapes)
    assert all(n.startswith("mtp.layers.0.") for n in model.mtp_weights)
    with pytest.raises(ValueError, match=r"BailingHybrid \(num_mtp_layers=1.*transformers"):
        make_llm(ckpt, spec={"method": "mtp", "num_draft_tokens": 2})
    out = make_llm(ckpt).generate_ids([[5, 6, 7]], [GREEDY])  # without spec it serves
    assert len(out[0].token_ids) == GREEDY.max_tokens


@pytest.mark.parametrize("family", ["kimi_linear", "minimax", "olmo_hybrid"])
def test_families_without_mtp_weights_refuse_speculation(family, tiny_checkpoint) -> None:
    with pytest.raises(ValueError, match="needs a checkpoint with an MTP head"):
        make_llm(tiny_checkpoint(family), spec={"method": "mtp", "num_draft_tokens": 2})
