"""Write a model's draft vocabulary (``workers/spec/draft_vocab.py``): the N tokens most
frequent in its training text, most frequent first. The writer stays apart from that reader:
counting needs the training corpus, which serving never loads.

    python -m tools.training.make_draft_vocab --model configs/models/qwen3-next-tiny-py --size 1024

Without ``--text`` the text is the default model's own training split (the Python standard
library, ``tools/training/corpus.py``) and the file records the share of the held-out
split's tokens the subset covers.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from tools.training.corpus import read_corpus, stdlib_files, stdlib_root
from tools.training.readme import put_section
from workers.spec.draft_vocab import FILE_NAME

HELDOUT_PERCENT = 3  # the default model's split (tools/training/train_default.py)
HEADING = "## Draft vocabulary"


def token_counts(tokenizer, texts: Iterable[str]) -> Counter[int]:
    counts: Counter[int] = Counter()
    for enc in tokenizer.encode_batch(list(texts)):
        counts.update(enc.ids)
    return counts


def coverage(counts: Counter[int], token_ids: list[int]) -> float:
    """The share of the counted tokens that are in ``token_ids``."""
    total = sum(counts.values())
    chosen = set(token_ids)
    return sum(n for t, n in counts.items() if t in chosen) / total if total else 0.0


def build(tokenizer, train: list[str], heldout: list[str], size: int, source: str) -> dict:
    counts = token_counts(tokenizer, train)
    # most frequent first; ties by id, so the file is the same on every run
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    out = {
        "token_ids": ranked,
        "source": source,
        "train_tokens": sum(counts.values()),
        "train_coverage": round(coverage(counts, ranked), 4),
    }
    if heldout:
        out["heldout_coverage"] = round(coverage(token_counts(tokenizer, heldout), ranked), 4)
    return out


def readme_section(out: dict, size: int, vocab_size: int) -> str:
    held = f", held-out {out['heldout_coverage']:.3f}" if "heldout_coverage" in out else ""
    return f"""{HEADING}

`{FILE_NAME}`: the {len(out["token_ids"]):,} most frequent tokens of the {out["source"]}
({out["train_tokens"]:,} tokens; they cover {out["train_coverage"]:.3f} of them{held}), most frequent
first. The MTP drafter scores these instead of all {vocab_size:,} (`spec.draft_vocab`, default
`auto`: this file when present), so each chained draft reads
{len(out["token_ids"]) / vocab_size:.2f} of the lm-head; verification scores every token, so
outputs do not change.

```
python -m tools.training.make_draft_vocab --model DIR --size {size}
```

"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model", required=True, type=Path, help="model directory (its tokenizer.json; the file goes there)"
    )
    ap.add_argument("--size", type=int, default=1024, help="tokens in the subset")
    ap.add_argument(
        "--text",
        nargs="*",
        type=Path,
        default=None,
        help="UTF-8 text files to count (default: the stdlib training split)",
    )
    args = ap.parse_args(argv)
    if args.size < 1:
        raise SystemExit(f"--size must be >= 1, got {args.size}")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    if args.text:
        train, heldout, source = [p.read_text(encoding="utf-8") for p in args.text], [], "files given"
    else:
        root = stdlib_root()
        train, heldout = read_corpus(stdlib_files(root), root, HELDOUT_PERCENT)
        source = f"Python standard library training split ({len(train)} files)"
    out = build(tokenizer, train, heldout, args.size, source)
    (args.model / FILE_NAME).write_text(json.dumps(out) + "\n")
    if (args.model / "README.md").exists():
        put_section(args.model / "README.md", HEADING, readme_section(out, args.size, tokenizer.get_vocab_size()))
    print(
        f"wrote {args.model / FILE_NAME}: {len(out['token_ids'])} tokens, "
        f"train coverage {out['train_coverage']}, held-out {out.get('heldout_coverage')}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
