"""In-process measurements for the suite (no Ray): the engine driven step by step, the
``run-batch`` path, transformers ``generate`` and a bare forward loop, on the same model.

``engine_records`` times requests inside one process with the client's definitions: it
adds every request at once, steps the engine, and stamps each request's first generated
token and its finish, giving ``metrics.RequestRecord``s (TTFT, ITL per engine output, E2EL).
Timings are ``time.perf_counter`` around real work; nothing is simulated.

On a shared machine, other processes only ever slow a run down, so the comparisons use the
best of ``repeats`` interleaved runs (A B A B ...), reported with every sample.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from cluster.bench.metrics import RequestRecord
from workers.forward_batch import ForwardBatch, is_decode_only
from workers.llm import LLM
from workers.sampling.params import SamplingParams

CPU = {"device": "cpu", "dtype": "float32"}
# the bench model's dims: a random 8-layer Qwen3-Next of ~15M parameters (``make_bench_model``)
BENCH_DIMS = dict(
    hidden_size=256,
    num_hidden_layers=8,
    layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=256,
    shared_expert_intermediate_size=256,
    intermediate_size=512,
)


def engine_kwargs(compile_cfg: Any, batch: int, all_sizes: bool = False) -> dict[str, Any]:
    """``LLM`` keyword overrides of a suite engine: the CPU settings and, when the suite
    compiles, one compiled bucket of ``batch`` (smaller batches pad up to it), or with
    ``all_sizes`` the default buckets below it too (a batch whose size varies: continuous
    batching's tail runs in the bucket that holds it, as with the default config)."""
    if not compile_cfg.enabled:
        return dict(CPU)
    from configs.schema import CompileConfig

    sizes = [b for b in CompileConfig().batch_sizes if b < batch] + [batch] if all_sizes else [batch]
    return {**CPU, "compile": {"enabled": True, "batch_sizes": sizes, "cache_dir": compile_cfg.cache_dir}}


def make_bench_model(out_dir: Path) -> Path:
    """The engine-overhead bench model (a random 8-layer Qwen3-Next, ~15M parameters, seed 0)."""
    from tools.tiny import make_tiny_checkpoint

    if (out_dir / "config.json").exists():
        return out_dir
    return make_tiny_checkpoint("qwen3_next", out_dir, seed=0, **BENCH_DIMS)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def engine_records(llm: LLM, prompts: Sequence[list[int]], max_tokens: int) -> tuple[list[RequestRecord], float]:
    """Run ``prompts`` together through the engine; (records, wall seconds)."""
    engine = llm.engine
    start = time.perf_counter()
    ids = []
    for i, p in enumerate(prompts):
        rid = f"bench-{time.monotonic_ns()}-{i}"
        engine.add_request(rid, list(p), greedy(max_tokens))
        ids.append(rid)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    gaps: dict[str, list[float]] = {rid: [] for rid in ids}
    num_out = dict.fromkeys(ids, 0)
    done: dict[str, Any] = {}
    while len(done) < len(ids) or engine.has_unfinished():
        for out in engine.step():
            if out.request_id not in gaps or not out.new_token_ids:
                if out.finished and out.request_id in gaps:
                    done[out.request_id] = out
                continue
            num_out[out.request_id] += len(out.new_token_ids)
            now = time.perf_counter()
            if out.request_id in first:
                gaps[out.request_id].append(now - last[out.request_id])
            else:
                first[out.request_id] = now
            last[out.request_id] = now
            if out.finished:
                done[out.request_id] = out
    wall = time.perf_counter() - start
    records = [
        RequestRecord(
            True, start, first[r] - start, last[r] - start, tuple(gaps[r]), len(p), num_out[r], done[r].cached_tokens
        )
        for r, p in zip(ids, prompts)
    ]
    return records, wall


def interleaved(runs: dict[str, Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    """Each run ``repeats`` times, alternating: {name: [value per repeat]}."""
    out: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            out[name].append(fn())
    return out


# -- overlap and speculation (engine only) --------------------------------------------------------
def throughput_run(llm: LLM, prompts: Sequence[list[int]], max_tokens: int) -> float:
    """Output tokens per second of one batch, prefill included."""
    llm.flush_cache()
    records, wall = engine_records(llm, prompts, max_tokens)
    return sum(r.output_tokens for r in records) / wall


def tpot_run(llm: LLM, prompts: Sequence[list[int]], max_tokens: int) -> float:
    """Mean TPOT (s) of the prompts sent one at a time (batch 1)."""
    tpots = []
    for p in prompts:
        llm.flush_cache()
        (record,), _ = engine_records(llm, [p], max_tokens)
        tpots.append(record.tpot or 0.0)
    return sum(tpots) / len(tpots)


def spec_acceptance(llm: LLM) -> float | None:
    s = llm.stats()
    drafted = int(s.get("hybridserve_spec_draft_tokens_total", 0) or 0)
    accepted = int(s.get("hybridserve_spec_accepted_tokens_total", 0) or 0)
    return round(accepted / drafted, 3) if drafted else None


# -- run-batch against transformers generate ----------------------------------------------------------
def run_batch_seconds(llm: LLM, prompts: Sequence[list[int]], max_tokens: int) -> float:
    """Wall time of ``hybridserve run-batch``'s path (JSONL in, bodies out) on ``prompts``."""
    from cluster.api.run_batch import run_batch

    lines = [
        json.dumps(
            {
                "custom_id": str(i),
                "method": "POST",
                "url": "/v1/completions",
                "body": {"prompt": list(p), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
            }
        )
        for i, p in enumerate(prompts)
    ]
    llm.flush_cache()
    start = time.perf_counter()
    results = run_batch(llm, lines, "bench")
    wall = time.perf_counter() - start
    bad = [r["error"] for r in results if r["error"]]
    if bad:
        raise RuntimeError(f"run-batch failed: {bad[0]}")
    return wall


class HFGenerate:
    """transformers ``generate`` on a left-padded batch: greedy, exactly ``max_tokens`` new."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    @torch.inference_mode()
    def seconds(self, prompts: Sequence[list[int]], max_tokens: int) -> float:
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        start = time.perf_counter()
        self.model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        return time.perf_counter() - start


# -- the bare forward loop --------------------------------------------------------------------------
def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bare_decode_rate(llm: LLM, prompts: list[list[int]], out_tokens: int) -> float:
    """Decode tok/s of the model's forward in a tight loop on pre-built decode batches (no
    scheduler), through the engine's compiled decode step when ``compile.enabled`` (the same
    path as the engine). Rate = batch * (out_tokens - 1) / (time(out_tokens) - time(1))."""
    engine = llm.engine
    model, pools, ps = engine.model, engine.pools, engine.config.cache.page_size
    b, plen = len(prompts), len(prompts[0])
    total = plen + out_tokens
    pages_per = -(-total // ps)
    page_table = torch.arange(1, 1 + b * pages_per, dtype=torch.int32).view(b, pages_per)
    slots = torch.arange(1, b + 1, dtype=torch.int32)

    def batch(ids: torch.Tensor, start: int, q: int) -> ForwardBatch:
        pos = torch.arange(start, start + q).repeat(b)
        rows = torch.arange(b).repeat_interleave(q)
        out_loc = page_table[rows, pos // ps].long() * ps + pos % ps
        return ForwardBatch(
            ids.reshape(-1),
            pos,
            torch.arange(0, b * q + 1, q, dtype=torch.int32),
            torch.full((b,), start + q, dtype=torch.int32),
            out_loc,
            page_table,
            slots,
            torch.full((b,), start > 0),
            torch.arange(q - 1, b * q, q),
            ps,
            decode_only=is_decode_only([q] * b, [start > 0] * b, None),
        )

    compiled = engine.runner.compiled  # the engine's compiled decode step, when it has one

    def logits(fb: ForwardBatch) -> torch.Tensor:
        bucket = compiled.pick(fb) if compiled is not None else None
        if bucket is None:
            return model.compute_logits(model.forward(fb, pools)[fb.logits_indices])
        assert compiled is not None
        return compiled.run(fb, bucket)[1][fb.logits_indices]

    @torch.inference_mode()
    def run(n: int) -> None:
        fb = batch(torch.tensor(prompts), 0, plen)
        tok = logits(fb).argmax(-1)
        for step in range(n - 1):
            fb = batch(tok, plen + step, 1)
            tok = logits(fb).argmax(-1)
        tok.tolist()

    run(2)
    t_full, t_one = _timed(lambda: run(out_tokens)), _timed(lambda: run(1))
    return b * (out_tokens - 1) / (t_full - t_one)


def quiet_transformers() -> None:
    import logging

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
