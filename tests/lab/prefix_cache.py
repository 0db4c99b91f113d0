"""Prefix caching on a shared-prefix workload, cache on against cache off, one process.

    python -m tests.lab.prefix_cache --systems 8 --questions 8 --system-len 256

Workload: ``systems`` random system prompts of ``system-len`` tokens, each followed by
``questions`` distinct questions of 16-48 tokens, sent one request at a time (a single
client) in interleaved order. Reports the fraction of prompt tokens actually computed and
mean time to first token (engine-measured, arrival to first token), for each setting.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from workers.llm import LLM
from workers.sampling.params import SamplingParams


def workload(vocab: int, systems: int, questions: int, system_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    heads = [[rng.randrange(3, vocab - 8) for _ in range(system_len)] for _ in range(systems)]
    prompts = [
        h + [rng.randrange(3, vocab - 8) for _ in range(rng.randrange(16, 49))] for h in heads for _ in range(questions)
    ]
    order = [i * questions + j for j in range(questions) for i in range(systems)]  # interleave groups
    return [prompts[i] for i in order]


def run(model_dir: Path, prompts: list[list[int]], cache_on: bool, page_size: int) -> dict[str, float]:
    llm = LLM(
        model=str(model_dir),
        device="cpu",
        dtype="float32",
        cache={"enable_prefix_cache": cache_on, "page_size": page_size, "max_kv_tokens": 65536},
    )
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm.generate_ids(prompts[:1], [params])  # warm-up, then start clean
    llm.flush_cache()
    before = llm.stats()
    start = time.perf_counter()
    ttfts = []
    for p in prompts:
        t0 = time.perf_counter()
        llm.generate_ids([p], [SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)])
        ttfts.append(time.perf_counter() - t0)
    stats = llm.stats()
    query = sum(map(len, prompts))
    hit = stats["hybridserve_prefix_hit_tokens_total"] - before["hybridserve_prefix_hit_tokens_total"]
    return {
        "cache": cache_on,
        "prompt_tokens": query,
        "hit_tokens": hit,
        "computed_fraction": round(1 - hit / query, 4),
        "mean_ttft_ms": round(1000 * sum(ttfts) / len(ttfts), 2),
        "wall_s": round(time.perf_counter() - start, 2),
    }


def main(argv: list[str] | None = None) -> None:
    from cluster.bench.inproc import BENCH_DIMS
    from tools.tiny import make_tiny_checkpoint

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--systems", type=int, default=8)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=16)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_checkpoint("qwen3_next", Path(tmp) / "m", seed=0, **BENCH_DIMS)
        prompts = workload(512, args.systems, args.questions, args.system_len)
        off = run(model_dir, prompts, False, args.page_size)
        on = run(model_dir, prompts, True, args.page_size)
    print(json.dumps(off))
    print(json.dumps(on))
    print(
        json.dumps(
            {
                "computed_fraction_on": on["computed_fraction"],
                "ttft_ratio_on_over_off": round(on["mean_ttft_ms"] / off["mean_ttft_ms"], 3),
            }
        )
    )


if __name__ == "__main__":
    main()
