"""The cost of sampling features on the decode hot path: decode tokens/s at one batch
size with a json_schema constraint against without, and with every penalty on against off.

    python -m tests.lab.sampling_cost --batch 16 --out-tokens 64 --repeats 3

In-process engine (the ``run-batch`` path) on the suite's ~15M-parameter random Qwen3-Next
(``cluster.bench.inproc.BENCH_DIMS``); decode rate = batch * (out_tokens - 1) / (time(out_tokens) - time(1)),
so prefill and the first token cancel out. The variants are interleaved and repeated and
the best run of each is kept (a shared machine's noise only slows runs down). The grammar
(an integer array of at least 4 * out_tokens items) cannot finish within out_tokens, so
every decode step is constrained: ``constrained_steps`` reports the fraction that was.
Figures mean something only on an otherwise idle machine; one JSON line per variant.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from workers.llm import LLM
from workers.sampling.params import SamplingParams
from workers.sampling.structured import StructuredOutput


def variants(out_tokens: int) -> dict[str, SamplingParams]:
    base = SamplingParams(max_tokens=out_tokens, temperature=0.0, ignore_eos=True)
    array = {"type": "array", "items": {"type": "integer"}, "minItems": 4 * out_tokens}
    penalties = replace(
        base,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias=((5, 1.0), (9, -1.0), (11, 2.0)),
        min_tokens=out_tokens,
    )
    return {
        "greedy": base,
        "greedy_json_schema": replace(
            base, structured_output=StructuredOutput.json_schema(array, any_whitespace=False)
        ),
        "greedy_penalties": penalties,
        "sampled": replace(base, temperature=1.0, seed=0),
        "sampled_penalties_filters": replace(penalties, temperature=1.0, top_p=0.9, top_k=50, min_p=0.02, seed=0),
    }


def decode_rate(llm: LLM, prompts: list[list[int]], p: SamplingParams) -> tuple[float, float]:
    """(tokens/s, fraction of outputs that stayed under their grammar)."""

    def run(n: int) -> list:
        return llm.generate_ids(prompts, [replace(p, max_tokens=n, min_tokens=min(p.min_tokens, n))] * len(prompts))

    start = time.perf_counter()
    outs = run(p.max_tokens)
    t_full = time.perf_counter() - start
    start = time.perf_counter()
    run(1)
    t_one = time.perf_counter() - start
    eos = llm.engine.eos_token_id
    constrained = sum(eos not in o.token_ids for o in outs) / len(outs) if p.structured_output else 0.0
    return len(prompts) * (p.max_tokens - 1) / max(t_full - t_one, 1e-9), constrained


def main(argv: list[str] | None = None) -> None:
    from cluster.bench.inproc import BENCH_DIMS
    from tools.tiny import make_tiny_checkpoint

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--out-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="the test-size model (to check the script runs)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        dims = {} if args.tiny else BENCH_DIMS
        model_dir = make_tiny_checkpoint("qwen3_next", Path(tmp) / "m", seed=0, **dims)
        llm = LLM(
            model=str(model_dir),
            device="cpu",
            dtype="float32",
            cache={"page_size": 16, "max_kv_tokens": 65536, "enable_prefix_cache": False},
        )
        rng = random.Random(0)
        prompts = [
            [rng.randrange(3, llm.engine.vocab_size - 8) for _ in range(args.prompt_len)] for _ in range(args.batch)
        ]
        cases = variants(args.out_tokens)
        for p in cases.values():  # warm-up, grammar compiled
            decode_rate(llm, prompts, replace(p, max_tokens=2, min_tokens=min(p.min_tokens, 2)))
        best: dict[str, tuple[float, float]] = {}
        for _ in range(args.repeats):
            for name, p in cases.items():
                rate, constrained = decode_rate(llm, prompts, p)
                if name not in best or rate > best[name][0]:
                    best[name] = (rate, constrained)
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        for name, (rate, constrained) in best.items():
            ref = best["sampled" if name.startswith("sampled") else "greedy"][0]
            print(
                json.dumps(
                    {
                        "variant": name,
                        "batch": args.batch,
                        "out_tokens": args.out_tokens,
                        "decode_tok_s": round(rate, 1),
                        "vs_plain": round(rate / ref, 3),
                        "constrained_steps": (round(constrained, 3) if name.endswith("json_schema") else None),
                        "threads": torch.get_num_threads(),
                        "load_avg_1m": load,
                    }
                )
            )


if __name__ == "__main__":
    main()
