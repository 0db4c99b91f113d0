"""The default model's training data: the Python standard library's own source, split into
train / held-out files by a hash of the path, and the byte-level BPE tokenizer trained on it."""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import torch

from tools.tiny_text import EOS_TOKEN, SPECIAL_TOKENS, write_tokenizer_config

# Not training text: the docs-as-data module, codec tables, build-time config dumps.
EXCLUDED_DIRS = ("site-packages", "dist-packages", "pydoc_data", "encodings", "__pycache__", "lib2to3/tests/data")
EXCLUDED_PREFIXES = ("_sysconfigdata", "config-")
MAX_FILE_BYTES = 400_000
# Pre-tokenizer split: a word or a punctuation run takes ONE trailing space ("def ", "= ",
# "return "); other whitespace (newline + indentation) is its own piece. GPT-2's split puts
# the space in front of the next word instead, so a prompt ending in a space ("def ") ends
# on a lone-space token the model never saw in training; with this split it is in-domain.
PRETOKENIZE_PATTERN = r"[\p{L}\p{N}_]+ ?|[^\s\p{L}\p{N}_]+ ?|\s+"


# --- data -----------------------------------------------------------------------------------
def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The training corpus: the stdlib's .py files, sorted by relative path."""
    root = root or stdlib_root()
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if any(f"/{d}/" in f"/{rel}" for d in EXCLUDED_DIRS):
            continue
        if rel.split("/")[0].startswith(EXCLUDED_PREFIXES):
            continue
        if not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
            continue
        out.append(path)
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def is_heldout(rel_path: str, percent: int) -> bool:
    digest = hashlib.sha256(rel_path.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < percent


def read_corpus(files: list[Path], root: Path, percent: int) -> tuple[list[str], list[str]]:
    """(train texts, held-out texts); files that are not UTF-8 are skipped."""
    train, heldout = [], []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        rel = path.relative_to(root).as_posix()
        (heldout if is_heldout(rel, percent) else train).append(text)
    return train, heldout


# --- tokenizer ------------------------------------------------------------------------------
def train_tokenizer(texts: list[str], out_dir: Path, vocab_size: int):
    """Byte-level BPE as ``tools.tiny.build_tiny_tokenizer`` (same specials, same
    ChatML template), on ``texts``, with ``PRETOKENIZE_PATTERN`` as the pre-token split."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    out_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    write_tokenizer_config(out_dir)
    return tok


def encode_stream(tok, texts: list[str]) -> torch.Tensor:
    """All texts as one int64 stream, each followed by ``<|endoftext|>``."""
    eos = tok.token_to_id(EOS_TOKEN)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int64)
