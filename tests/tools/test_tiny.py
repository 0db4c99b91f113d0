"""The tiny tokenizer / checkpoint factory and the shipped placeholder model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.workers.models.harness import Harness, random_prompts
from tools.tiny import build_tiny_tokenizer, make_tiny_checkpoint
from workers.loader import load_model

PLACEHOLDER = Path(__file__).resolve().parents[2] / "configs" / "models" / "tiny-hybrid"


def test_tokenizer_is_deterministic_and_loads_offline(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    assert build_tiny_tokenizer(tmp_path / "a") == build_tiny_tokenizer(tmp_path / "b") == 512
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "a"))
    assert len(tok) == 512
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    text = "def hello(world):\n    return 42  # héllo ✓"
    assert tok.decode(tok(text)["input_ids"]) == text
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Hi there"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(chat)["input_ids"]
    assert ids[0] == 1 and ids.count(2) == 1


def test_same_seed_same_weights_other_seed_differs(tmp_path: Path) -> None:
    a = make_tiny_checkpoint("granitemoehybrid", tmp_path / "a", seed=11)
    b = make_tiny_checkpoint("granitemoehybrid", tmp_path / "b", seed=11)
    c = make_tiny_checkpoint("granitemoehybrid", tmp_path / "c", seed=12)
    data = [(d / "model.safetensors").read_bytes() for d in (a, b, c)]
    assert data[0] == data[1] != data[2]


def test_unknown_arch_and_mtp_misuse_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="qwen3_next"):
        make_tiny_checkpoint("llama", tmp_path)
    with pytest.raises(ValueError, match="mtp"):
        make_tiny_checkpoint("granitemoehybrid", tmp_path, mtp=True)


def test_placeholder_model_is_shipped_small_and_loads() -> None:
    files = {p.name for p in PLACEHOLDER.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md"} <= files
    assert sum(p.stat().st_size for p in PLACEHOLDER.iterdir()) < 2 * 1024 * 1024
    assert "placeholder" in (PLACEHOLDER / "README.md").read_text()
    model = load_model(PLACEHOLDER, torch.float32, "cpu").model
    assert model.config.architectures == ["Qwen3NextForCausalLM"]
    assert "mtp.fc.weight" in model.mtp_weights


def test_placeholder_greedy_output_does_not_collapse() -> None:
    model = load_model(PLACEHOLDER, torch.float32, "cpu").model
    prompts = random_prompts(model.config.vocab_size, [5, 9, 14], seed=0)
    harness = Harness(model)
    tokens = [int(x[-1].argmax()) for x in harness.prefill(prompts)]
    outputs = [[t] for t in tokens]
    for _ in range(15):
        tokens = [int(x.argmax()) for x in harness.decode(tokens)]
        for out, t in zip(outputs, tokens):
            out.append(t)
    assert all(len(set(out)) >= 6 for out in outputs), outputs


def test_registry_redraw_rule_is_asked_first() -> None:
    from tools.tiny_weights import redraw_model_

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    seen: list[str] = []

    def rule(name: str, t: torch.Tensor, gen: torch.Generator) -> bool:
        seen.append(name)
        if name == "0.bias":
            t.fill_(7.0)
            return True
        return False

    redraw_model_(model, seed=1, zero_centered_norms=False, rule=rule)
    assert seen == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert bool((model[0].bias == 7.0).all()) and not bool((model[0].weight == 0).all())
