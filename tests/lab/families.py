"""Decode tokens/s per registered model family: the engine against transformers ``generate``.

    python -m tests.lab.families [--families mamba2 zamba2] [--batch 8] [--out-tokens 32]
                                 [--prompt-len 32] [--repeats 3]

For each family of ``tools.tiny_registry`` (default: all), builds its tiny
checkpoint, then measures, interleaved ``--repeats`` times, the engine's decode rate (the
``run-batch`` path, ``LLM.generate_ids``) and transformers' on the same prompts (batch of
``--batch`` random prompts of ``--prompt-len`` tokens, greedy, ``--out-tokens`` new tokens;
rate = batch * (out_tokens - 1) / (time(out_tokens) - time(1)), so prefill cancels), and
keeps the best of each. One JSON line per family, with the load average before and after:
the figures mean something only on an otherwise idle machine (DESIGN §7).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
from pathlib import Path

import torch

from tests.lab.engine_overhead import engine_decode_rate, hf_decode_rate
from workers.llm import LLM


def measure_family(
    name: str, out_dir: Path, batch: int, prompt_len: int, out_tokens: int, repeats: int
) -> dict[str, object]:
    import transformers

    from tools.tiny import make_tiny_checkpoint

    load_before = os.getloadavg()
    model_dir = make_tiny_checkpoint(name, out_dir / name, seed=0)
    llm = LLM(model=str(model_dir), device="cpu", dtype="float32", cache={"page_size": 16, "max_kv_tokens": 65536})
    # transformers' own class of the checkpoint (a VL one runs its full model on text)
    architecture = json.loads((model_dir / "config.json").read_text())["architectures"][0]
    hf = getattr(transformers, architecture).from_pretrained(str(model_dir), dtype=torch.float32).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, llm.engine.vocab_size - 8) for _ in range(prompt_len)] for _ in range(batch)]
    engine_best = hf_best = float("-inf")  # a rate <= 0 means time(n) <= time(1): noise
    for _ in range(repeats):  # interleaved: both sides see the same load
        engine_best = max(engine_best, engine_decode_rate(llm, prompts, out_tokens))
        hf_best = max(hf_best, hf_decode_rate(hf, prompts, out_tokens))
    return {
        "family": name,
        "architecture": architecture,
        "params": sum(p.numel() for p in llm.engine.model.parameters()),
        "batch": batch,
        "engine_tok_s": round(engine_best, 1),
        "hf_generate_tok_s": round(hf_best, 1),
        "engine_over_hf": round(engine_best / hf_best, 3) if min(engine_best, hf_best) > 0 else None,
        "repeats": repeats,
        "torch_threads": torch.get_num_threads(),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }


def main(argv: list[str] | None = None) -> None:
    from tools.tiny_registry import TINY_FAMILIES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=list(TINY_FAMILIES), choices=list(TINY_FAMILIES))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--out-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    if args.out_tokens < 2 or args.repeats < 1:
        raise ValueError(f"--out-tokens={args.out_tokens} must be >= 2 and --repeats={args.repeats} >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.families:
            row = measure_family(name, Path(tmp), args.batch, args.prompt_len, args.out_tokens, args.repeats)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
