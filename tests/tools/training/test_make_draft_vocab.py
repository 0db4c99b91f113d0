"""``python -m tools.training.make_draft_vocab``: the most frequent tokens of a text, most
frequent first (ties by id), with the share of tokens they cover, in the file the engine
reads (``workers/spec/draft_vocab.py``)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from tools.training import make_draft_vocab
from workers.spec.draft_vocab import FILE_NAME, read_token_ids


class CharTokenizer:
    """One token per character: its code point."""

    def encode_batch(self, texts):
        return [SimpleNamespace(ids=[ord(c) for c in t]) for t in texts]


def test_the_most_frequent_tokens_first_ties_by_id():
    out = make_draft_vocab.build(CharTokenizer(), ["aaabbc", "bd"], ["ab", "zz"], size=3, source="test")
    assert out["token_ids"] == [ord("a"), ord("b"), ord("c")]  # a 3, b 3 (id order), c 1 = d 1
    assert out["train_tokens"] == 8 and out["train_coverage"] == round(7 / 8, 4)
    assert out["heldout_coverage"] == 0.5


def test_the_tool_writes_what_the_engine_reads(tmp_path, monkeypatch, tiny_qwen_dir):
    model = tmp_path / "m"
    model.mkdir()
    (model / "tokenizer.json").write_bytes((tiny_qwen_dir / "tokenizer.json").read_bytes())
    text = tmp_path / "t.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 20)
    assert make_draft_vocab.main(["--model", str(model), "--size", "8", "--text", str(text)]) == 0
    written = json.loads((model / FILE_NAME).read_text())
    vocab_size = json.loads((tiny_qwen_dir / "config.json").read_text())["vocab_size"]
    assert read_token_ids(model / FILE_NAME, vocab_size) == written["token_ids"]
    assert 0 < len(written["token_ids"]) <= 8 and written["source"] == "files given"
