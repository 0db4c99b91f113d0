"""Stage (c) of the device checks, its step rows: one decode step of a ~1B dense and a ~2B MoE
random Qwen3-Next, eager and captured as a CUDA graph, against the HBM bandwidth bound (the
engine's rows: ``bench_engine``; the stage's plan: ``bench_stage``).

The dense model has Qwen3-Next's real head dims (attention 16 query / 2 KV heads of 256; GDN
16 key / 32 value heads of 128), hidden 2048 and 16 layers (12 GDN, 4 attention), with a
dense SwiGLU MLP (5632) in every layer: 1.07B parameters in bf16, drawn on the GPU (no
checkpoint on disk). The MoE model is the same with a top-8 of 64 experts (256 wide) and a
shared expert (1024) in every layer: 2.2B parameters, ~0.8B active per token.

Per batch size, one decode step at context ``CONTEXT`` (every sequence decoding its next
token):
- eager: the model's forward and logits on a decode-only ``ForwardBatch``, every op in its
  Triton kernel (GDN update, conv update, norms, paged attention: the ``triton`` backend, so
  FlashInfer, whose plain wrappers a graph cannot hold, is left out even where installed); the
  MoE's experts through its per-expert loop, which reads the per-expert counts on the host;
- CUDA graph: the same step in the formulation a compiled step runs
  (``kernels.static.static_formulation``), captured by hand with ``torch.cuda.CUDAGraph`` and
  replayed. The graph's logits are checked against that formulation's eager step on the same
  pool contents; a step that reads the host (``host_reads``) is named and not captured. The
  dry run (CPU) runs the same bookkeeping without a graph.

There is no grouped expert kernel on CUDA (``workers/models/moe.py``): a captured MoE step
gathers each (token, choice)'s expert weights when T*k < E and otherwise runs every expert on
every token (E/k times the expert rows a grouped kernel would compute); the ``experts``
column says which, so the MoE rows are not read as a grouped kernel's.

The bound counts what a step must move at least once: every weight (of the routed experts,
those some token picks: their expected number under uniform routing), each sequence's
recurrent states (read and written, fp32) and its KV, over ``--bandwidth-gbs`` (4.8 TB/s).
"""

from __future__ import annotations

import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch

from kernels import backend
from kernels.static import static_formulation
from tests.gpu.common import Compared, compare, cuda_ms
from tests.gpu.host_reads import host_reads

ONE_B = dict(
    hidden_size=2048,
    num_hidden_layers=16,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 4,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    intermediate_size=5632,
    mlp_only_layers=list(range(16)),
)
MOE_2B = dict(
    ONE_B,
    mlp_only_layers=[],
    num_experts=64,
    num_experts_per_tok=8,
    moe_intermediate_size=256,
    shared_expert_intermediate_size=1024,
    decoder_sparse_step=1,
    norm_topk_prob=True,
)
TOY = dict(
    ONE_B,
    hidden_size=64,
    num_hidden_layers=4,
    layer_types=ONE_B["layer_types"][:4],
    num_attention_heads=4,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    intermediate_size=128,
    mlp_only_layers=list(range(4)),
)
TOY_MOE = dict(
    TOY,
    mlp_only_layers=[],
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    decoder_sparse_step=1,
    norm_topk_prob=True,
)
MODELS = {"dense": ONE_B, "moe": MOE_2B}
TOY_MODELS = {"dense": TOY, "moe": TOY_MOE}
BATCHES, TOY_BATCHES = [1, 32, 128, 256], [2]
CONTEXT, PAGE_SIZE = 512, 16
COLUMNS = [
    "model",
    "experts (captured step)",
    "batch",
    "context",
    "GB/step",
    "bound tok/s",
    "eager ms",
    "eager tok/s",
    "graph ms",
    "graph tok/s",
    "graph % bound",
    "graph vs eager logits",
]


class Bench(NamedTuple):
    model: Any  # HybridForCausalLM
    hf_config: Any
    model_dir: Path  # config.json + tokenizer: what the engine is built from


class StepRow(NamedTuple):
    cells: list[object]  # one per COLUMNS
    ok: bool  # the step captured, graph logits = eager logits
    bound_tok_s: float
    graph_tok_s: float | None


def build(dims: dict, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Bench:
    """The random model on ``device`` (weights drawn there, as ``make_tiny_checkpoint`` would)."""
    from tools.tiny import build_tiny_tokenizer, redraw_, tiny_config
    from tools.tiny_text import EOS_TOKEN, SPECIAL_TOKENS
    from workers.models import get_model_class

    out = Path(tempfile.mkdtemp(prefix="hybridserve-bench-"))
    vocab = build_tiny_tokenizer(out)
    cfg = tiny_config(
        "qwen3_next", vocab, SPECIAL_TOKENS.index(EOS_TOKEN), architectures=["Qwen3NextForCausalLM"], **dims
    )
    cfg.save_pretrained(str(out))
    model = get_model_class("Qwen3NextForCausalLM")(cfg, dtype, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            redraw_(name, p, gen, zero_centered_norms=True)
    return Bench(model.eval(), cfg, out)


def _moe_layers(model: Any) -> list[Any]:
    from workers.models.moe import SparseMoE

    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def weight_bytes(model: Any, num_tokens: int) -> float:
    """Weight bytes a step of ``num_tokens`` tokens reads at least: every weight, but of each
    MoE layer's routed experts only those some token picks (expected under uniform routing:
    E * (1 - (1 - k/E)^T) of E)."""
    total = float(sum(p.numel() * p.element_size() for p in model.parameters()))
    for moe in _moe_layers(model):
        experts = sum(w.numel() * w.element_size() for w in (moe.w_gate, moe.w_up, moe.w_down) if w is not None)
        e, k = moe.dims.num_experts, moe.dims.top_k
        total -= experts * (1 - k / e) ** num_tokens
    return total


def experts_path(model: Any, num_tokens: int) -> str:
    """What a captured step computes for the routed experts (``SparseMoE._routed_static``)."""
    moes = _moe_layers(model)
    if not moes:
        return "dense MLP"
    e, k = moes[0].dims.num_experts, moes[0].dims.top_k
    if num_tokens * k < e:
        return f"gathered rows ({num_tokens * k} of {e} experts' weights read per layer)"
    return f"every expert on every token: {e / k:g}x the rows; no grouped kernel"


def decode_step(
    bench: Bench, batch: int, device: torch.device, dtype: torch.dtype
) -> tuple[Callable[[], torch.Tensor], Any, float]:
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
        cu_seqlens=torch.arange(batch + 1, **i32),
        seq_lens=torch.full((batch,), CONTEXT + 1, **i32),
        out_loc=out_loc,
        page_table=table,
        mamba_slot_ids=torch.arange(1, batch + 1, **i32),
        has_initial_state=torch.ones(batch, dtype=torch.bool, device=device),
        logits_indices=torch.arange(batch, device=device),
        page_size=PAGE_SIZE,
        decode_only=True,
    )
    pools = build_pools(spec, batch * pages + 1, PAGE_SIZE, batch + 1, dtype, device)
    model = bench.model

    def step() -> torch.Tensor:
        hidden = model(fb, pools)
        return model.compute_logits(hidden[fb.logits_indices])

    per_seq = 2 * spec.bytes_per_slot(dtype) + (CONTEXT + 1) * spec.bytes_per_token(dtype)
    return step, pools, weight_bytes(model, batch) + batch * per_seq


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
    step()  # compiled, and the kernels' memoised launch plans built
    _sync(_pool_tensors(pools)[0].device)
    replay, logits = capture(step)
    saved = [t.clone() for t in _pool_tensors(pools)]
    eager = step()
    for t, s in zip(_pool_tensors(pools), saved):
        t.copy_(s)
    replay()
    _sync(_pool_tensors(pools)[0].device)
    return replay, compare(logits, eager, 1e-2, 1e-2)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def step_row(
    name: str, bench: Bench, batch: int, device: torch.device, dtype: torch.dtype, bandwidth_gbs: float, iters: int
) -> StepRow:
    """One table row (see ``COLUMNS``); ok when the step captured and its logits matched."""
    with torch.inference_mode(), backend.use_backend("triton"):
        step, pools, nbytes = decode_step(bench, batch, device, dtype)
        bound_ms = nbytes / (bandwidth_gbs * 1e6)
        eager_ms = _time(step, iters)
        capture = capture_cuda if device.type == "cuda" else capture_eager
        with static_formulation():  # what a compiled step runs (no host reads)
            graph_ms, graph_cell, graph_ok = _graph_columns(step, pools, capture, iters)
        del pools

    def tok_s(ms: float | None) -> float | None:
        return None if ms is None else batch * 1e3 / ms

    def pct(ms: float | None) -> str | None:
        return None if ms is None else f"{100 * bound_ms / ms:.1f}%"

    cells = [
        name,
        experts_path(bench.model, batch),
        batch,
        CONTEXT,
        nbytes / 1e9,
        tok_s(bound_ms),
        eager_ms,
        tok_s(eager_ms),
        graph_ms,
        tok_s(graph_ms),
        pct(graph_ms),
        graph_cell,
    ]
    return StepRow(cells, graph_ok, tok_s(bound_ms) or 0.0, tok_s(graph_ms))


def _graph_columns(step: Step, pools: Any, capture: Capture, iters: int) -> tuple[float | None, str, bool]:
    """(graph ms, the logits-check cell, ok). A step that reads the host is not captured (the
    capture would fail); the reads are named instead, as is a capture that fails."""
    reads = host_reads(step)
    if reads:
        return None, f"**not captured**: host reads {sorted(set(reads))[:3]}", False
    try:
        replay, graph = graph_step(step, pools, capture)
    except Exception as exc:  # the eager numbers stand without the graph's
        traceback.print_exc()
        return None, f"**capture failed**: {type(exc).__name__}: {exc}"[:120], False
    cell = f"{'ok' if graph.ok else '**FAIL**'} ({graph.max_err:.2g})"
    return _time(replay, iters), cell, graph.ok


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
