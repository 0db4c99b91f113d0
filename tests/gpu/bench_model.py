"""Engine decode throughput of a ~1B-parameter random-weight Qwen3-Next vs the bandwidth bound.

Decode step time = (time of a run generating 4 + N tokens - time of one generating 4) / N,
both with the same batch of fresh prompts (prefix cache off), so prefill cancels out. The
bound reads every weight once per step (a 64-sequence batch touches every expert) plus each
sequence's recurrent states (read and written) and its KV.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from kernels import backend

# ~1.07B parameters: 12 GDN + 4 attention layers, hidden 2048, 10 experts of 512 (top 2).
ONE_B = dict(hidden_size=2048, num_hidden_layers=16,
             layer_types=["linear_attention"] * 3 + ["full_attention"],
             num_attention_heads=16, num_key_value_heads=2, head_dim=256,
             linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
             linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=10,
             num_experts_per_tok=2, moe_intermediate_size=512,
             shared_expert_intermediate_size=512, intermediate_size=5632, mlp_only_layers=[])
PROMPT_LEN, WARM_TOKENS = 32, 4


def build_checkpoint(smoke: bool) -> Path:
    from workers.models.tiny import make_tiny_checkpoint

    out = Path(tempfile.mkdtemp(prefix="hybridserve-bench-"))
    if smoke:
        return make_tiny_checkpoint("qwen3_next", out, seed=0)
    cfg = dict(ONE_B, layer_types=ONE_B["layer_types"] * 4)
    return make_tiny_checkpoint("qwen3_next", out, seed=0, **cfg)


def step_bytes(llm, batch: int, context: int) -> tuple[float, int]:
    """(bytes one decode step must move, parameter count)."""
    params = sum(p.numel() for p in llm.engine.model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())
    mamba = llm.engine.pools.mamba
    per_slot = (mamba.conv[:, 0].numel() * mamba.conv.element_size()
                + mamba.ssm[:, 0].numel() * mamba.ssm.element_size())
    kv = llm.engine.pools.kv
    kv_per_token = kv.k[:, 0].numel() * kv.k.element_size() * 2
    return weight_bytes + batch * (2 * per_slot + context * kv_per_token), params


def generate_seconds(llm, prompts: list[list[int]], max_tokens: int) -> float:
    from workers.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate_ids(prompts, [params] * len(prompts))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def decode_step_ms(llm, batch: int, new_tokens: int, seed: int) -> float:
    gen = torch.Generator().manual_seed(seed)
    vocab = min(llm.engine.vocab_size, 500)

    def prompts() -> list[list[int]]:
        return torch.randint(10, vocab, (batch, PROMPT_LEN), generator=gen).tolist()

    generate_seconds(llm, prompts(), WARM_TOKENS)              # compile + warm every kernel
    short = generate_seconds(llm, prompts(), WARM_TOKENS)
    long = generate_seconds(llm, prompts(), WARM_TOKENS + new_tokens)
    return (long - short) * 1e3 / new_tokens


def bench_decode_throughput(device: torch.device, smoke: bool, bandwidth_gbs: float) -> None:
    try:
        from workers.llm import LLM
    except ImportError as exc:
        print(f"\nmodel decode throughput: skipped, the engine cannot be imported ({exc})")
        return
    batch, new_tokens = (2, 2) if smoke else (64, 64)
    t0 = time.perf_counter()
    model_dir = build_checkpoint(smoke)
    print(f"\nmodel: random-weight Qwen3-Next checkpoint in {time.perf_counter() - t0:.0f}s")
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    llm = LLM(model=str(model_dir), device=device.type, dtype=dtype,
              cache={"page_size": 16, "max_kv_tokens": 2 * batch * 256,
                     "enable_prefix_cache": False},
              scheduler={"max_running_requests": batch, "max_batch_tokens": 8192,
                         "chunked_prefill_size": 4096})
    context = PROMPT_LEN + WARM_TOKENS + new_tokens // 2
    nbytes, params = step_bytes(llm, batch, context)
    bound_ms = nbytes / (bandwidth_gbs * 1e6)
    print(f"{params / 1e9:.2f}B parameters ({dtype}); batch {batch}; {nbytes / 1e9:.2f} GB per "
          f"decode step -> bound {bound_ms:.3f} ms/step = {batch / bound_ms * 1e3:,.0f} tok/s")
    gpu = "auto" if device.type == "cuda" else "triton"
    for label, setting in (("gpu kernels", gpu), ("torch reference", "torch")):
        with backend.use_backend(setting):
            ms = decode_step_ms(llm, batch, new_tokens if setting != "torch" else
                                max(2, new_tokens // 4), seed=1)
        print(f"decode [{label:<15}] {ms:8.2f} ms/step  {batch / ms * 1e3:10,.0f} tok/s  "
              f"{100 * bound_ms / ms:5.1f}% of the bandwidth bound", flush=True)
