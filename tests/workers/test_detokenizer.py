from __future__ import annotations

import pytest

from workers.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from tools.tiny import build_tiny_tokenizer

    d = tmp_path_factory.mktemp("tok")
    build_tiny_tokenizer(d)
    return AutoTokenizer.from_pretrained(str(d))


TEXTS = ["def main():\n    return 42\n", "naïve café — ünïcödé ✓ 你好", "a  b\t\tc\n\n"]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer)
    streamed = ""
    for t in ids:
        d.append(t)
        streamed += d.stream_delta(False)
        assert "\ufffd" not in streamed
    d.flush()
    streamed += d.stream_delta(True)
    assert d.text == tokenizer.decode(ids, skip_special_tokens=True) == streamed


def test_stop_string_across_tokens_and_holdback(tokenizer):
    text = "alpha beta gamma delta"
    ids = tokenizer.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer, stop=("gamma",))
    streamed, stopped_at = "", None
    for i, t in enumerate(ids):
        if d.append(t):
            stopped_at = i
            break
        streamed += d.stream_delta(False)
        assert "gam" not in streamed
    assert stopped_at is not None
    streamed += d.stream_delta(True)
    assert d.text == "alpha beta " == streamed


def test_include_stop_string(tokenizer):
    ids = tokenizer.encode("one two three", add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer, stop=("two",), include_stop_str=True)
    for t in ids:
        if d.append(t):
            break
    assert d.text == "one two"
