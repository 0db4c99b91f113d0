"""Suite sections of compiled steps: continuous batching where arithmetic matters, and start-up time
with compilation.

``eos_workload``: a random Qwen3-Next of ~100M parameters with its real head dims (attention
256, GDN 128), prompts of 32-256 tokens, output lengths drawn from a log-normal and each
request stopping at its own length, as it would at EOS (a random model's EOS comes at no
length one can choose; the stop is the same on both sides). The engine runs them with
``batch`` requests in flight (continuous batching: a finished request's place is taken at
once); transformers ``generate`` runs them in arrival order, ``batch`` per left-padded batch,
each batch until its longest output (what ``generate`` does when its sequences end at EOS at
different steps). Wall time over the same tokens: engine ÷ generate.

``startup``: seconds from ``LLM(...)`` to ready, each in a fresh process: eager, compiled
with an empty compile cache (cold), and compiled again over that cache (warm); of each, the
seconds spent compiling or loading the steps, inductor's cache counters and the load average.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

from cluster.bench import inproc
from cluster.bench.suite_config import SuiteConfig

MODEL_100M = dict(
    hidden_size=768,
    num_hidden_layers=8,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=384,
    shared_expert_intermediate_size=384,
    intermediate_size=1536,
    max_position_embeddings=4096,
)
PROJECT_ROOT = Path(__file__).resolve().parents[2]


def make_model_100m(out_dir: Path) -> Path:
    from tools.tiny import make_tiny_checkpoint

    if (out_dir / "config.json").exists():
        return out_dir
    return make_tiny_checkpoint("qwen3_next", out_dir, seed=0, **MODEL_100M)


def num_parameters(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():
                n = 1
                for d in st.get_slice(key).get_shape():
                    n *= d
                total += n
    return total


def _workload(c: Any) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(3)
    prompts = [
        [rng.randrange(16, 500) for _ in range(rng.randint(c.min_prompt_len, c.max_prompt_len))]
        for _ in range(c.num_prompts)
    ]
    mid = (c.min_output_len * c.max_output_len) ** 0.5  # log-normal around the geometric mean
    lengths = [min(c.max_output_len, max(c.min_output_len, round(rng.lognormvariate(0.0, 0.7) * mid))) for _ in prompts]
    return prompts, lengths


def _engine_seconds(llm: Any, prompts: list[list[int]], lengths: list[int]) -> float:
    from workers.sampling.params import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    llm.flush_cache()
    start = time.perf_counter()
    outs = llm.generate_ids(prompts, params)
    wall = time.perf_counter() - start
    got = [len(o.token_ids) for o in outs]
    if got != lengths:
        raise RuntimeError(f"engine output lengths {got[:8]} differ from the workload's {lengths[:8]}")
    return wall


def _hf_seconds(hf: inproc.HFGenerate, prompts: list[list[int]], lengths: list[int], batch: int) -> float:
    return sum(hf.seconds(prompts[i : i + batch], max(lengths[i : i + batch])) for i in range(0, len(prompts), batch))


def eos_workload(cfg: SuiteConfig, out_dir: Path) -> dict[str, Any]:
    from workers.llm import LLM

    c = cfg.eos_workload
    model = make_model_100m(out_dir / "models" / "qwen3-next-100m")
    prompts, lengths = _workload(c)
    llm = LLM(
        model=str(model),
        **inproc.engine_kwargs(cfg.compile, c.batch, all_sizes=True),
        cache={"max_kv_tokens": 32768},
        scheduler={"max_running_requests": c.batch},
    )
    hf = inproc.HFGenerate(model)
    samples = inproc.interleaved(
        {
            "engine_s": lambda: _engine_seconds(llm, prompts, lengths),
            "hf_s": lambda: _hf_seconds(hf, prompts, lengths, c.batch),
        },
        c.repeats or cfg.repeats,
    )
    engine_s, hf_s = min(samples["engine_s"]), min(samples["hf_s"])
    tokens = sum(lengths)
    return {
        "eos_workload_speedup": round(hf_s / engine_s, 3),
        "engine_tok_s": round(tokens / engine_s, 1),
        "hf_tok_s": round(tokens / hf_s, 1),
        "num_parameters": num_parameters(model),
        "output_lens": lengths,
        "prompt_lens": [len(p) for p in prompts],
        "batch": c.batch,
        "samples_s": {k: [round(v, 3) for v in vs] for k, vs in samples.items()},
        "model": str(model),
    }


_STARTUP = """
import json, os, sys, time
t0 = time.perf_counter()
from workers.llm import LLM
llm = LLM(model=sys.argv[1], device="cpu", dtype="float32",
          compile={"enabled": sys.argv[2] == "1", "batch_sizes": [int(b) for b in sys.argv[3].split(",")],
                   "cache_dir": sys.argv[4]})
seconds = time.perf_counter() - t0
from workers.compiled.cache import cache_counters
compiled = llm.engine.runner.compiled
times = compiled.compile_times if compiled else (0.0, 0.0)
print("STARTUP " + json.dumps({"seconds": seconds, "compile_s": times[0], "compile_cpu_s": times[1],
                               "cache": cache_counters(), "loadavg": os.getloadavg()}))
"""


class StartupRun(NamedTuple):
    seconds: float
    compile_s: float  # of which compiling (or loading) the steps
    compile_cpu_s: float  # the process's CPU time in that (the wall time on a free core)
    cache: dict[str, int]  # ``cache_counters()`` at the end of the start-up
    loadavg: tuple[float, float, float]


def _startup_run(model: Path, compiled: bool, sizes: list[int], cache_dir: Path) -> StartupRun:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            _STARTUP,
            str(model),
            "1" if compiled else "0",
            ",".join(map(str, sizes)),
            str(cache_dir),
        ],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
        check=True,
    )
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("STARTUP ")]
    if not line:
        raise RuntimeError(f"start-up run printed no time: {out.stderr[-500:]}")
    got = json.loads(line[-1].removeprefix("STARTUP "))
    return StartupRun(
        float(got["seconds"]), float(got["compile_s"]), float(got["compile_cpu_s"]), got["cache"], tuple(got["loadavg"])
    )


def startup(cfg: SuiteConfig, model: Path, out_dir: Path) -> dict[str, Any]:
    sizes = cfg.startup.batch_sizes
    cache = out_dir / "startup-compile-cache"
    shutil.rmtree(cache, ignore_errors=True)
    eager = _startup_run(model, False, sizes, cache)
    cold = _startup_run(model, True, sizes, cache)
    warm = _startup_run(model, True, sizes, cache)
    return {
        "startup_cold_s": round(cold.seconds, 1),
        "startup_warm_s": round(warm.seconds, 1),
        "startup_eager_s": round(eager.seconds, 1),
        "compile_cold_s": round(cold.compile_s, 1),
        "compile_warm_s": round(warm.compile_s, 1),
        "compile_cpu_cold_s": round(cold.compile_cpu_s, 1),
        "compile_cpu_warm_s": round(warm.compile_cpu_s, 1),
        "cache_cold": cold.cache,
        "cache_warm": warm.cache,
        "loadavg": {"eager": eager.loadavg, "cold": cold.loadavg, "warm": warm.loadavg},
        "batch_sizes": sizes,
        "model": str(model),
    }
