"""Serving-path overhead: decode tokens/s of the engine against a bare forward loop and
against transformers ``generate``, same model, same prompts, same batch, one process.

    python -m tests.lab.engine_overhead --batch 1 32 --out-tokens 64

Builds the suite's ~15M-parameter random Qwen3-Next (``inproc.BENCH_DIMS``), prompts of 32 random tokens.
Decode rate = batch * (out_tokens - 1) / (time(out_tokens) - time(1)), so prefill and
first-token time cancel out. Reports a JSON line per batch size.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from cluster.bench.inproc import BENCH_DIMS, bare_decode_rate
from workers.llm import LLM
from workers.sampling.params import SamplingParams


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def engine_decode_rate(llm: LLM, prompts: list[list[int]], out_tokens: int) -> float:
    def run(n: int) -> None:
        llm.generate_ids(prompts, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)] * len(prompts))

    run(2)  # warm-up
    t_full, t_one = _timed(lambda: run(out_tokens)), _timed(lambda: run(1))
    return len(prompts) * (out_tokens - 1) / (t_full - t_one)


def hf_decode_rate(model_dir: Path | torch.nn.Module, prompts: list[list[int]], out_tokens: int) -> float:
    """transformers ``generate`` on the checkpoint (or on an already loaded HF model)."""
    from transformers import AutoModelForCausalLM

    model = (
        model_dir
        if isinstance(model_dir, torch.nn.Module)
        else AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    )
    ids = torch.tensor(prompts)

    @torch.inference_mode()
    def run(n: int) -> None:
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )

    run(2)
    t_full, t_one = _timed(lambda: run(out_tokens)), _timed(lambda: run(1))
    return len(prompts) * (out_tokens - 1) / (t_full - t_one)


def main(argv: list[str] | None = None) -> None:
    from tools.tiny import make_tiny_checkpoint

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--out-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    args = ap.parse_args(argv)
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_checkpoint("qwen3_next", Path(tmp) / "m", seed=0, **BENCH_DIMS)
        llm = LLM(model=str(model_dir), device="cpu", dtype="float32", cache={"page_size": 16, "max_kv_tokens": 65536})
        params = sum(p.numel() for p in llm.engine.model.parameters())
        rng = random.Random(0)
        for b in args.batch:
            prompts = [[rng.randrange(3, llm.engine.vocab_size - 8) for _ in range(args.prompt_len)] for _ in range(b)]
            eng = engine_decode_rate(llm, prompts, args.out_tokens)
            bare = bare_decode_rate(llm, prompts, args.out_tokens)
            hf = hf_decode_rate(model_dir, prompts, args.out_tokens)
            print(
                json.dumps(
                    {
                        "params": params,
                        "batch": b,
                        "engine_tok_s": round(eng, 1),
                        "bare_loop_tok_s": round(bare, 1),
                        "hf_generate_tok_s": round(hf, 1),
                        "engine_over_bare": round(eng / bare, 3),
                        "engine_over_hf": round(eng / hf, 3),
                    }
                )
            )


if __name__ == "__main__":
    main()
