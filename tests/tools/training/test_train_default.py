"""The default-model training script, end to end on tiny sizes (a few steps, seconds), and
the MTP head's semantics and checkpoint layout."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from tests.tools.training.conftest import TINY_SHAPE, tiny_settings
from tools.training import corpus
from tools.training import train_default as td
from tools.training.mtp_head import TrainableMtpHead
from workers.loader import load_model


def test_split_is_fixed_and_small() -> None:
    root = corpus.stdlib_root()
    rels = [p.relative_to(root).as_posix() for p in corpus.stdlib_files(root)]
    assert rels == sorted(rels) and len(rels) > 100
    assert not any("site-packages" in r or r.startswith("encodings/") for r in rels)
    held = [r for r in rels if corpus.is_heldout(r, 3)]
    assert 0 < len(held) < 0.08 * len(rels)
    assert held == [r for r in rels if corpus.is_heldout(r, 3)]


def test_run_writes_a_dir_the_loader_serves(trained) -> None:
    out, info = trained
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md"} <= {
        p.name for p in out.iterdir()
    }
    loaded = load_model(out, torch.float32, "cpu")
    cfg = loaded.hf_config
    assert cfg.architectures == ["Qwen3NextForCausalLM"] and cfg.tie_word_embeddings
    assert "full_attention" in cfg.layer_types and "linear_attention" in cfg.layer_types
    mtp = loaded.model.mtp_weights
    tensors = load_file(str(out / "model.safetensors"))
    full = cfg.layer_types.index("full_attention")
    src = f"model.layers.{full}."
    main_layer = {k[len(src) :]: tuple(v.shape) for k, v in tensors.items() if k.startswith(src)}
    mtp_layer = {k[len("mtp.layers.0.") :]: tuple(v.shape) for k, v in mtp.items() if k.startswith("mtp.layers.0.")}
    assert mtp_layer == main_layer and "mlp.experts.3.gate_proj.weight" in mtp_layer
    h = cfg.hidden_size
    assert tuple(mtp["mtp.fc.weight"].shape) == (h, 2 * h)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        assert tuple(mtp[f"mtp.{name}.weight"].shape) == (h,)
    assert len(mtp) == len(main_layer) + 4
    readme = (out / "README.md").read_text()
    assert "MTP acceptance" in readme and "unigram baseline" in readme
    assert 0.0 <= info["eval"]["mtp_acceptance"] <= 1.0
    assert info["train"]["steps"] == 3


def test_tokenizer_has_the_specials_and_chat_template(trained) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(trained[0]))
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    text = "def f(self):\n    return 42  # é"
    assert tok.decode(tok(text)["input_ids"]) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_saved_mtp_head_round_trips(trained) -> None:
    out, _ = trained
    model, mtp = td.load_saved(out)
    tensors = load_file(str(out / "model.safetensors"))
    again = mtp.checkpoint_tensors()
    assert again.keys() == {k for k in tensors if k.startswith("mtp.")}
    assert all(torch.equal(again[k], tensors[k]) for k in again)


def test_mtp_is_causal_and_uses_next_token() -> None:
    cfg = td.hf_config(td.ModelShape(vocab_size=64, **TINY_SHAPE), eos_id=0)
    torch.manual_seed(0)
    mtp = TrainableMtpHead(cfg)
    mtp.init_weights(torch.Generator().manual_seed(1), std=0.2)
    mtp.eval()
    hidden, emb = torch.randn(1, 10, 32), torch.randn(1, 10, 32)
    pos = torch.arange(1, 11)[None]
    with torch.no_grad():
        base = mtp(hidden, emb, pos)
        later = emb.clone()
        later[:, 6:] += 1.0
        moved = mtp(hidden, later, pos)  # positions < 6 unaffected
        assert torch.allclose(base[:, :6], moved[:, :6], atol=1e-6)
        assert not torch.allclose(base[:, 6:], moved[:, 6:])
        other = emb.clone()
        other[:, 3] += 1.0  # e_{t+1} feeds position t
        assert not torch.allclose(base[:, 3], mtp(hidden, other, pos)[:, 3])
        # RoPE is relative: trained with row t at position t + 1, served (workers/models/mtp.py,
        # like vLLM) at position t; a uniform shift leaves the output unchanged.
        assert torch.allclose(base, mtp(hidden, emb, pos - 1), atol=1e-5)


def test_training_step_lowers_the_loss() -> None:
    torch.manual_seed(0)
    cfg = td.hf_config(td.ModelShape(vocab_size=64, **TINY_SHAPE), eos_id=0)
    model, mtp = td.build_model(cfg, seed=0)
    stream = torch.arange(400) % 7 + 3  # a periodic, learnable stream
    info = td.train(model, mtp, stream, tiny_settings(steps=25, lr=1e-2, amp=False), log=lambda *a: None)
    first, last = info["history"][0], info["history"][-1]
    assert info["steps"] == 25
    assert last[2] < first[2] - 1.0 and last[3] < first[3] - 1.0
