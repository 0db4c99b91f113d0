"""Stage (c) of the device checks: decode throughput of a ~1B random Qwen3-Next against the
HBM bandwidth bound, with CUDA graphs off and on.

The model has Qwen3-Next's real head dims (attention 16 query / 2 KV heads of 256; GDN 16 key
/ 32 value heads of 128), hidden 2048 and 16 layers (12 GDN, 4 attention), with a dense
SwiGLU MLP (5632) in every layer: 1.07B parameters in bf16, drawn on the GPU (no checkpoint
on disk). Dense rather than MoE: eagerly our MoE layer reads its per-expert token counts on
the host (``workers/models/moe.py``; only its traced formulation, which compiled steps run,
is free of host reads), and the hand-captured graph below runs the step as it is.

Per batch size, one decode step at context ``CONTEXT`` (every sequence decoding its next
token):
- eager: the model's forward and logits on a decode-only ``ForwardBatch``, every op in its
  Triton kernel (GDN update, conv update, norms, paged attention: the ``triton`` backend, so
  FlashInfer, whose plain wrappers a graph cannot hold, is left out even where installed);
- CUDA graph: the same step captured by hand with ``torch.cuda.CUDAGraph`` and replayed
  (the ops take their traced formulation while the stream captures: ``kernels.static``). The
  graph's logits are checked against the eager step's on the same pool contents; a step that
  reads the host (``host_reads``) is named and not captured. The dry run (CPU) runs the same
  bookkeeping without a graph;
- engine: tokens/s of ``Engine.step`` decoding (scheduler, sampling, output processing
  included; the ``auto`` backend), from two runs that differ only in their number of decode
  steps: eager, and with the engine's compiled steps (``compile.enabled``, one bucket of the
  row's batch size: inductor + CUDA graphs, ``workers/compiled``). The compiled engine runs on
  the GPU only (the dry run's CPU would spend its stage budget compiling).

The bound counts what a step must move at least once: every weight, each sequence's
recurrent states (read and written, fp32) and its KV, over ``--bandwidth-gbs`` (4.8 TB/s).
"""
from __future__ import annotations

import itertools
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch

from kernels import backend
from tests.gpu.common import Compared, Deadline, Report, compare, cuda_ms
from tests.gpu.host_reads import host_reads

ONE_B = dict(hidden_size=2048, num_hidden_layers=16,
             layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 4,
             num_attention_heads=16, num_key_value_heads=2, head_dim=256,
             linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
             linear_value_head_dim=128, linear_conv_kernel_dim=4, intermediate_size=5632,
             mlp_only_layers=list(range(16)))
TOY = dict(ONE_B, hidden_size=64, num_hidden_layers=4, layer_types=ONE_B["layer_types"][:4],
           num_attention_heads=4, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
           linear_key_head_dim=16, linear_value_head_dim=16, intermediate_size=128,
           mlp_only_layers=list(range(4)))
BATCHES, TOY_BATCHES = [1, 32, 128], [2]
CONTEXT, PAGE_SIZE = 512, 16
ENGINE_PROMPT, ENGINE_WARM, ENGINE_STEPS = 32, 4, 32
COLUMNS = ["batch", "context", "GB/step", "bound tok/s", "eager ms", "eager tok/s", "eager % bound",
           "graph ms", "graph tok/s", "graph % bound", "graph vs eager logits", "engine tok/s",
           "engine compiled tok/s", "compiled start-up s"]


class EngineRun(NamedTuple):
    tok_s: float                # decode tokens/s
    startup_s: float            # building the engine, its compiled steps' compilation included


class Bench(NamedTuple):
    model: Any                  # HybridForCausalLM
    hf_config: Any
    model_dir: Path             # config.json + tokenizer: what the engine is built from


def build(dims: dict, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Bench:
    """The random model on ``device`` (weights drawn there, as ``make_tiny_checkpoint`` would)."""
    from workers.models import get_model_class
    from workers.models.tiny import build_tiny_tokenizer, redraw_, tiny_config
    from workers.models.tiny_text import EOS_TOKEN, SPECIAL_TOKENS

    out = Path(tempfile.mkdtemp(prefix="hybridserve-bench-"))
    vocab = build_tiny_tokenizer(out)
    cfg = tiny_config("qwen3_next", vocab, SPECIAL_TOKENS.index(EOS_TOKEN),
                      architectures=["Qwen3NextForCausalLM"], **dims)
    cfg.save_pretrained(str(out))
    model = get_model_class("Qwen3NextForCausalLM")(cfg, dtype, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            redraw_(name, p, gen, zero_centered_norms=True)
    return Bench(model.eval(), cfg, out)


def decode_step(bench: Bench, batch: int, device: torch.device,
                dtype: torch.dtype) -> tuple[Callable[[], torch.Tensor], Any, int]:
    """(step -> logits, the pools, bytes the step must move) for ``batch`` sequences each
    decoding position ``CONTEXT`` (distinct pages and slots; slot 0 / page 0 unused)."""
    from workers.device_pools import build_pools
    from workers.forward_batch import ForwardBatch

    spec = bench.model.cache_spec()
    pages = -(-(CONTEXT + 1) // PAGE_SIZE)
    i32 = dict(dtype=torch.int32, device=device)
    table = torch.arange(1, batch * pages + 1, **i32).view(batch, pages)
    out_loc = table[:, CONTEXT // PAGE_SIZE].long() * PAGE_SIZE + CONTEXT % PAGE_SIZE
    fb = ForwardBatch(
        input_ids=torch.randint(10, bench.hf_config.vocab_size, (batch,), device=device),
        positions=torch.full((batch,), CONTEXT, dtype=torch.long, device=device),
        cu_seqlens=torch.arange(batch + 1, **i32), seq_lens=torch.full((batch,), CONTEXT + 1, **i32),
        out_loc=out_loc, page_table=table, mamba_slot_ids=torch.arange(1, batch + 1, **i32),
        has_initial_state=torch.ones(batch, dtype=torch.bool, device=device),
        logits_indices=torch.arange(batch, device=device), page_size=PAGE_SIZE, decode_only=True)
    pools = build_pools(spec, batch * pages + 1, PAGE_SIZE, batch + 1, dtype, device)
    model = bench.model

    def step() -> torch.Tensor:
        hidden = model(fb, pools)
        return model.compute_logits(hidden[fb.logits_indices])

    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    per_seq = 2 * spec.bytes_per_slot(dtype) + (CONTEXT + 1) * spec.bytes_per_token(dtype)
    return step, pools, weights + batch * per_seq


def _pool_tensors(pools: Any) -> list[torch.Tensor]:
    return [*pools.kv.tensors(), *pools.mamba.tensors()]


Step = Callable[[], torch.Tensor]
Capture = Callable[[Step], tuple[Callable[[], Any], torch.Tensor]]


def capture_cuda(step: Step) -> tuple[Callable[[], Any], torch.Tensor]:
    """(replay, the output buffer that each replay rewrites): a CUDA graph of the step."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph.replay, out


def capture_eager(step: Step) -> tuple[Callable[[], Any], torch.Tensor]:
    """The dry run's stand-in for ``capture_cuda``: the same contract, no graph (CPU)."""
    out = step()
    return (lambda: out.copy_(step())), out


def graph_step(step: Step, pools: Any, capture: Capture) -> tuple[Callable[[], Any], Compared]:
    """(replay, graph logits vs eager logits): the step captured, checked on the same pool
    contents as one eager step (the step updates the pools in place)."""
    step()
    step()                       # compiled, and the kernels' memoised launch plans built
    _sync(_pool_tensors(pools)[0].device)
    replay, logits = capture(step)
    saved = [t.clone() for t in _pool_tensors(pools)]
    eager = step()
    for t, s in zip(_pool_tensors(pools), saved):
        t.copy_(s)
    replay()
    _sync(_pool_tensors(pools)[0].device)
    return replay, compare(logits, eager, 1e-2, 1e-2)


def engine_tok_s(bench: Bench, batch: int, device: torch.device, dtype: torch.dtype,
                 compiled: bool = False) -> EngineRun:
    """Decode tokens/s of the engine (eager, or with its compiled steps at bucket ``batch``):
    (long run - short run) / their extra tokens; and its start-up time."""
    from configs.schema import load_config
    from workers.engine import Engine
    from workers.loader import LoadedModel
    from workers.sampling_params import SamplingParams

    loaded = LoadedModel(bench.model, bench.hf_config)
    engine_cls = type("PrebuiltEngine", (Engine,), {"_load_model": lambda self, _dir: loaded})
    tokens = ENGINE_PROMPT + ENGINE_WARM + ENGINE_STEPS + PAGE_SIZE
    config = load_config(overrides=dict(
        model=str(bench.model_dir), device=device.type, dtype=str(dtype).replace("torch.", ""),
        cache={"page_size": PAGE_SIZE, "max_kv_tokens": batch * tokens,
               "enable_prefix_cache": False},
        scheduler={"max_running_requests": batch, "max_batch_tokens": 8192,
                   "chunked_prefill_size": 4096},
        compile={"enabled": compiled, "batch_sizes": [batch]}))
    t0 = time.perf_counter()
    engine = engine_cls(config)
    startup_s = time.perf_counter() - t0
    ids = itertools.count()
    gen = torch.Generator().manual_seed(1)

    def run(max_tokens: int) -> float:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for prompt in torch.randint(10, 500, (batch, ENGINE_PROMPT), generator=gen).tolist():
            engine.add_request(f"bench-{next(ids)}", prompt, params)
        _sync(device)
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        _sync(device)
        return time.perf_counter() - t0

    try:
        run(ENGINE_WARM)                           # compile and warm every kernel
        short, long = run(ENGINE_WARM), run(ENGINE_WARM + ENGINE_STEPS)
    finally:
        engine.runner.shutdown()
    return EngineRun(batch * ENGINE_STEPS / max(long - short, 1e-9), startup_s)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_batch(bench: Bench, batch: int, device: torch.device, dtype: torch.dtype,
                bandwidth_gbs: float, iters: int) -> tuple[list[object], bool]:
    """One table row (see ``COLUMNS``) and whether its checks passed (the step captured, graph
    logits = eager logits, the engine ran)."""
    with torch.inference_mode(), backend.use_backend("triton"):
        step, pools, nbytes = decode_step(bench, batch, device, dtype)
        bound_ms = nbytes / (bandwidth_gbs * 1e6)
        eager_ms = _time(step, iters)
        capture = capture_cuda if device.type == "cuda" else capture_eager
        graph_ms, graph_cell, graph_ok = _graph_columns(step, pools, capture, iters)
        del pools
    engine = _engine_or_error(bench, batch, device, dtype)
    compiled = (_engine_or_error(bench, batch, device, dtype, compiled=True) if device.type == "cuda"
                else "n/a (dry run)")
    startup = compiled.startup_s if isinstance(compiled, EngineRun) else None

    def tok_s(ms: float | None) -> float | None:
        return None if ms is None else batch * 1e3 / ms

    def pct(ms: float | None) -> str | None:
        return None if ms is None else f"{100 * bound_ms / ms:.1f}%"
    cells = [batch, CONTEXT, nbytes / 1e9, tok_s(bound_ms), eager_ms, tok_s(eager_ms),
             pct(eager_ms), graph_ms, tok_s(graph_ms), pct(graph_ms), graph_cell, _tok_s_cell(engine),
             _tok_s_cell(compiled), startup]
    return cells, graph_ok and not isinstance(engine, str) and (device.type != "cuda"
                                                               or not isinstance(compiled, str))


def _tok_s_cell(run: object) -> object:
    return run.tok_s if isinstance(run, EngineRun) else run


def _graph_columns(step: Step, pools: Any, capture: Capture,
                   iters: int) -> tuple[float | None, str, bool]:
    """(graph ms, the logits-check cell, ok). A step that reads the host is not captured (the
    capture would fail); the reads are named instead, as is a capture that fails."""
    reads = host_reads(step)
    if reads:
        return None, f"**not captured**: host reads {sorted(set(reads))[:3]}", False
    try:
        replay, graph = graph_step(step, pools, capture)
    except Exception as exc:         # the eager numbers stand without the graph's
        traceback.print_exc()
        return None, f"**capture failed**: {type(exc).__name__}: {exc}"[:120], False
    cell = f"{'ok' if graph.ok else '**FAIL**'} ({graph.max_err:.2g})"
    return _time(replay, iters), cell, graph.ok


def _engine_or_error(bench: Bench, batch: int, device: torch.device, dtype: torch.dtype,
                     compiled: bool = False) -> object:
    try:
        return engine_tok_s(bench, batch, device, dtype, compiled)
    except Exception as exc:         # the forward numbers stand without the engine's
        traceback.print_exc()
        return f"{type(exc).__name__}: {exc}"[:120]


def _time(fn: Callable[[], Any], iters: int) -> float:
    """Milliseconds per call: CUDA events on a GPU, the wall clock on the CPU (dry run)."""
    ms = cuda_ms(fn, iters)
    if ms is not None:
        return ms
    fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


def run(report: Report, deadline: Deadline, dry_run: bool, bandwidth_gbs: float) -> None:
    device = torch.device("cpu" if dry_run else "cuda")
    dtype = torch.float32 if dry_run else torch.bfloat16
    t0 = time.perf_counter()
    bench = build(TOY if dry_run else ONE_B, device, dtype)
    params = sum(p.numel() for p in bench.model.parameters())
    report.note(f"{params / 1e6:,.0f}M parameters, {str(dtype).replace('torch.', '')}, built in "
                f"{time.perf_counter() - t0:.1f} s; engine rows: prompts of {ENGINE_PROMPT} "
                f"tokens, {ENGINE_STEPS} timed decode steps; bound at {bandwidth_gbs:,.0f} GB/s.")
    for batch in TOY_BATCHES if dry_run else BATCHES:
        if deadline.passed():
            report.row(batch, *[None] * (len(COLUMNS) - 2), "skipped: stage time limit", ok=False)
            continue
        try:
            cells, ok = bench_batch(bench, batch, device, dtype, bandwidth_gbs, 1 if dry_run else 10)
        except Exception as exc:
            traceback.print_exc()
            report.row(batch, *[None] * (len(COLUMNS) - 2), f"{type(exc).__name__}: {exc}"[:160],
                       ok=False)
            continue
        report.row(*cells, ok=ok)
