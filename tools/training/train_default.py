"""Train the shipped default model: a tiny Qwen3-Next (GDN + gated attention + MoE) with an
MTP head, on the Python standard library's own source.

    python -m tools.training.train_default --out configs/models/qwen3-next-tiny-py --minutes 25

Data: every ``.py`` file under ``sysconfig.get_paths()["stdlib"]`` (site-packages, codec
tables and docs-as-data excluded, see ``stdlib_files``), split into train / held-out by a
hash of the file's relative path. Tokenizer: byte-level BPE trained with ``tokenizers`` on the
training files (vocab 4096; ``<|endoftext|>`` = eos = pad, ``<|im_start|>``, ``<|im_end|>``;
ChatML chat template). Model: ``Qwen3NextForCausalLM`` from transformers (torch path, CPU)
plus ``tools.training.mtp_head.TrainableMtpHead``, trained jointly on
``CE(next token) + 0.3 * CE(MTP, token t+2) + router aux loss``. AdamW, linear warmup then
cosine decay; the schedule runs on ``max(step / steps, elapsed / budget)`` so a slower
machine still anneals and stops inside ``--minutes``. Seeds are fixed; with ``--steps``
given the run is fully determined by the data (the time budget only cuts it short).

Output: an HF model dir (config.json, model.safetensors holding ``model.*`` and ``mtp.*`` in
``--save-dtype``, tokenizer files, README.md with the held-out numbers and samples).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tools.training.corpus import EOS_TOKEN, encode_stream, read_corpus, stdlib_files, stdlib_root, train_tokenizer
from tools.training.model_dir import load_saved, save_model_dir
from tools.training.mtp_head import TrainableMtpHead, param_count
from tools.training.readme import write_readme

MTP_LOSS_WEIGHT = 0.3
SAMPLE_PROMPTS = ("def ", "import os\n", "class Foo:\n    def __init__(self", "    for i in range(", "if __name__ == ")


@dataclass
class ModelShape:
    """The knobs of the Qwen3-Next config (the rest is fixed in ``hf_config``)."""

    vocab_size: int = 4096
    hidden_size: int = 256
    num_blocks: int = 2  # each = 3 linear_attention + 1 full_attention layers
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 64
    linear_value_head_dim: int = 64
    intermediate_size: int = 384  # dense SwiGLU of the linear_attention layers
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 192
    shared_expert_intermediate_size: int = 192
    max_position_embeddings: int = 4096


@dataclass
class TrainSettings:
    seq_len: int = 256
    batch_size: int = 8
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    steps: int | None = None  # None: sized from the measured speed to fit minutes
    minutes: float = 25.0
    seed: int = 0
    threads: int = 1  # see main(): 2 OpenMP threads on 2 shared cores is slower
    amp: bool = True  # bfloat16 autocast for the matmuls (float32 weights)
    eval_windows: int = 64
    heldout_percent: int = 3
    tokenizer_vocab: int = 4096
    save_dtype: str = "float16"
    shape: ModelShape = field(default_factory=ModelShape)


# --- model ----------------------------------------------------------------------------------
def hf_config(shape: ModelShape, eos_id: int):
    from transformers import Qwen3NextConfig

    layer_types = ["linear_attention"] * 3 + ["full_attention"]
    return Qwen3NextConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        num_hidden_layers=4 * shape.num_blocks,
        layer_types=layer_types * shape.num_blocks,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        linear_num_key_heads=shape.linear_num_key_heads,
        linear_num_value_heads=shape.linear_num_value_heads,
        linear_key_head_dim=shape.linear_key_head_dim,
        linear_value_head_dim=shape.linear_value_head_dim,
        linear_conv_kernel_dim=4,
        intermediate_size=shape.intermediate_size,
        num_experts=shape.num_experts,
        num_experts_per_tok=shape.num_experts_per_tok,
        moe_intermediate_size=shape.moe_intermediate_size,
        shared_expert_intermediate_size=shape.shared_expert_intermediate_size,
        decoder_sparse_step=4,
        mlp_only_layers=[],
        norm_topk_prob=True,
        partial_rotary_factor=0.25,
        rope_theta=10000.0,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        bos_token_id=None,
        router_aux_loss_coef=0.001,
        attention_dropout=0.0,
    )


def build_model(cfg, seed: int):
    """(main ``Qwen3NextForCausalLM``, ``TrainableMtpHead``), initialised from ``seed``."""
    from transformers import Qwen3NextForCausalLM

    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(cfg)
    mtp = TrainableMtpHead(cfg)
    mtp.init_weights(torch.Generator().manual_seed(seed + 1), std=cfg.initializer_range)
    model.train()
    mtp.train()
    return model, mtp


@dataclass
class StepOut:
    loss: torch.Tensor
    main_ce: float
    mtp_ce: float
    aux: float


def forward_losses(model, mtp: TrainableMtpHead, window: torch.Tensor) -> StepOut:
    """window [B, T + 2]: inputs w[:, :T]; main targets w[:, 1:T+1]; MTP targets w[:, 2:]."""
    from transformers.models.qwen3_next.modeling_qwen3_next import load_balancing_loss_func

    cfg = model.config
    t = window.shape[1] - 2
    inputs, nxt, nxt2 = window[:, :t], window[:, 1 : t + 1], window[:, 2:]
    out = model.model(input_ids=inputs, use_cache=False, output_router_logits=True)
    hidden = out.last_hidden_state  # final-normed h_t
    logits = model.lm_head(hidden)
    main_ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), nxt.reshape(-1))
    pos = torch.arange(1, t + 1).unsqueeze(0).expand(window.shape[0], -1)
    mtp_hidden = mtp(hidden, model.model.embed_tokens(nxt), pos)
    mtp_logits = model.lm_head(mtp_hidden)
    mtp_ce = F.cross_entropy(mtp_logits.reshape(-1, mtp_logits.shape[-1]).float(), nxt2.reshape(-1))
    aux = load_balancing_loss_func(out.router_logits, cfg.num_experts, cfg.num_experts_per_tok)
    loss = main_ce + MTP_LOSS_WEIGHT * mtp_ce + cfg.router_aux_loss_coef * aux
    aux_value = float(aux.detach()) if torch.is_tensor(aux) else float(aux)
    return StepOut(loss, main_ce.item(), mtp_ce.item(), aux_value)


def sample_windows(stream: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - seq_len - 2, (batch,), generator=gen)
    return torch.stack([stream[s : s + seq_len + 2] for s in starts.tolist()])


def eval_windows(stream: torch.Tensor, n: int, seq_len: int) -> torch.Tensor:
    """``n`` evenly spaced, non-overlapping windows of the held-out stream (fixed)."""
    span = seq_len + 2
    count = min(n, len(stream) // span)
    stride = len(stream) // count
    return torch.stack([stream[i * stride : i * stride + span] for i in range(count)])


def lr_at(progress: float, step: int, s: TrainSettings) -> float:
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    cos = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * cos)


def make_optimizer(model, mtp: TrainableMtpHead, s: TrainSettings) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    seen: set[int] = set()
    for module in (model, mtp):
        for name, p in module.named_parameters():
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            (decay if p.dim() >= 2 and "embed_tokens" not in name else no_decay).append(p)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": s.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=s.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


def train(model, mtp: TrainableMtpHead, stream: torch.Tensor, s: TrainSettings, log=print) -> dict[str, Any]:
    """The training loop; returns what the README records about it."""
    gen = torch.Generator().manual_seed(s.seed + 2)
    opt = make_optimizer(model, mtp, s)
    params = [p for g in opt.param_groups for p in g["params"]]
    budget = s.minutes * 60.0
    steps = s.steps
    t0 = time.monotonic()
    step, history = 0, []
    ema = None
    while True:
        elapsed = time.monotonic() - t0
        # With --steps the schedule runs on steps (the budget only cuts it short, annealed);
        # without, on wall time, so the cosine ends exactly when the budget does.
        progress = elapsed / budget if steps is None else max(step / steps, elapsed / budget)
        if progress >= 1.0:
            break
        lr = lr_at(progress, step, s)
        for g in opt.param_groups:
            g["lr"] = lr
        window = sample_windows(stream, s.batch_size, s.seq_len, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=s.amp):
            out = forward_losses(model, mtp, window)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, s.grad_clip)
        opt.step()
        step += 1
        ema = out.main_ce if ema is None else 0.98 * ema + 0.02 * out.main_ce
        if step % 50 == 0 or step == 1:
            history.append((step, round(elapsed, 1), round(out.main_ce, 4), round(out.mtp_ce, 4)))
            log(
                f"step {step}/{steps} {elapsed:6.0f}s lr {lr:.2e} main {out.main_ce:.3f} "
                f"(ema {ema:.3f}) mtp {out.mtp_ce:.3f} aux {out.aux:.3f}"
            )
    wall = time.monotonic() - t0
    if step and (not history or history[-1][0] != step):
        history.append((step, round(wall, 1), round(out.main_ce, 4), round(out.mtp_ce, 4)))
    return {
        "steps": step,
        "train_seconds": round(wall, 1),
        "tokens_seen": step * s.batch_size * s.seq_len,
        "history": history,
    }


# --- evaluation -----------------------------------------------------------------------------
@torch.no_grad()
def evaluate(model, mtp: TrainableMtpHead, windows: torch.Tensor, batch: int = 16) -> dict[str, float]:
    """Held-out losses and the MTP greedy-draft acceptance.

    acceptance = P(argmax MTP(h_t, e_{t+1}) == argmax main(x_{<=t+1})), i.e. the draft for
    t + 2 made from the true token t + 1 equals what greedy decoding of the main model emits.
    """
    model.eval()
    mtp.eval()
    sums = {"main_ce": 0.0, "mtp_ce": 0.0, "main_acc": 0.0, "mtp_acc": 0.0, "accept": 0.0}
    n_main = n_mtp = 0
    for i in range(0, len(windows), batch):
        w = windows[i : i + batch]
        t = w.shape[1] - 2
        inputs, nxt, nxt2 = w[:, :t], w[:, 1 : t + 1], w[:, 2:]
        hidden = model.model(input_ids=inputs, use_cache=False).last_hidden_state
        logits = model.lm_head(hidden).float()
        pos = torch.arange(1, t + 1).unsqueeze(0).expand(w.shape[0], -1)
        mtp_logits = model.lm_head(mtp(hidden, model.model.embed_tokens(nxt), pos)).float()
        sums["main_ce"] += float(F.cross_entropy(logits.flatten(0, 1), nxt.flatten(), reduction="sum"))
        sums["main_acc"] += float((logits.argmax(-1) == nxt).sum())
        n_main += nxt.numel()
        # MTP at position t vs main at t + 1: both predict token t + 2 (positions 0..T-2).
        drafts = mtp_logits[:, :-1].argmax(-1)
        sums["accept"] += float((drafts == logits[:, 1:].argmax(-1)).sum())
        sums["mtp_ce"] += float(F.cross_entropy(mtp_logits.flatten(0, 1), nxt2.flatten(), reduction="sum"))
        sums["mtp_acc"] += float((mtp_logits.argmax(-1) == nxt2).sum())
        n_mtp += drafts.numel()
    model.train()
    mtp.train()
    return {
        "heldout_loss": sums["main_ce"] / n_main,
        "heldout_mtp_loss": sums["mtp_ce"] / n_main,
        "main_top1": sums["main_acc"] / n_main,
        "mtp_top1": sums["mtp_acc"] / n_main,
        "mtp_acceptance": sums["accept"] / n_mtp,
        "eval_tokens": n_main,
    }


def unigram_loss(train_stream: torch.Tensor, heldout: torch.Tensor, vocab: int) -> float:
    """Cross-entropy (nats/token) of add-one-smoothed train unigram frequencies on ``heldout``."""
    counts = torch.bincount(train_stream, minlength=vocab).double() + 1.0
    logp = torch.log(counts / counts.sum())
    return float(-logp[heldout].mean())


@torch.no_grad()
def greedy_samples(model, tok, prompts=SAMPLE_PROMPTS, max_new_tokens: int = 60) -> dict[str, str]:
    model.eval()
    out = {}
    for prompt in prompts:
        ids = torch.tensor([tok.encode(prompt).ids])
        gen = model.generate(
            ids,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=model.config.eos_token_id,
            pad_token_id=model.config.pad_token_id,
        )
        out[prompt] = tok.decode(gen[0].tolist(), skip_special_tokens=False)
    model.train()
    return out


@dataclass
class _Corpus:
    tok: Any
    vocab: int
    train_stream: torch.Tensor
    heldout_stream: torch.Tensor
    files_train: int
    files_heldout: int
    heldout_bytes: int


def _corpus(out_dir: Path, s: TrainSettings, log, max_files: int | None, t_start: float) -> _Corpus:
    """The standard library's files split, the tokenizer trained on the training part (saved
    in ``out_dir``) and both parts encoded."""
    root = stdlib_root()
    files = stdlib_files(root)
    if max_files is not None:
        files = files[:max_files]
    train_texts, heldout_texts = read_corpus(files, root, s.heldout_percent)
    if not heldout_texts:  # tiny test subsets: hold out the last file
        heldout_texts = train_texts[-1:]
        train_texts = train_texts[:-1]
    log(f"{len(train_texts)} train files, {len(heldout_texts)} held-out files")
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(train_texts, out_dir, s.tokenizer_vocab)
    vocab = tok.get_vocab_size()
    train_stream = encode_stream(tok, train_texts)
    heldout_stream = encode_stream(tok, heldout_texts)
    heldout_bytes = sum(len(t.encode()) for t in heldout_texts)
    log(
        f"vocab {vocab}; {len(train_stream)} train / {len(heldout_stream)} held-out tokens "
        f"({time.monotonic() - t_start:.0f}s)"
    )
    return _Corpus(tok, vocab, train_stream, heldout_stream, len(train_texts), len(heldout_texts), heldout_bytes)


# --- main -----------------------------------------------------------------------------------
def run(
    out_dir: Path, s: TrainSettings, command: str, log=print, max_files: int | None = None, sample_tokens: int = 60
) -> dict[str, Any]:
    t_start = time.monotonic()
    torch.set_num_threads(s.threads)
    torch.manual_seed(s.seed)
    corpus = _corpus(out_dir, s, log, max_files, t_start)
    tok, vocab, train_stream, heldout_stream = corpus.tok, corpus.vocab, corpus.train_stream, corpus.heldout_stream

    shape = s.shape
    shape.vocab_size = vocab
    cfg = hf_config(shape, tok.token_to_id(EOS_TOKEN))
    model, mtp = build_model(cfg, s.seed)
    log(f"params: main {param_count(model):,} mtp {param_count(mtp):,}")
    train_info = train(model, mtp, train_stream, s, log=log)
    save_model_dir(out_dir, model, mtp, s.save_dtype)

    model, mtp = load_saved(out_dir)  # numbers from the weights as shipped
    windows = eval_windows(heldout_stream, s.eval_windows, s.seq_len)
    ev = evaluate(model, mtp, windows)
    uni = unigram_loss(train_stream, windows[:, 1:-1].reshape(-1), vocab)
    samples = greedy_samples(model, tok, max_new_tokens=sample_tokens)
    import transformers

    info = {
        "command": command,
        "settings": asdict(s),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": s.threads,
        "vocab": vocab,
        "data": {
            "files_train": corpus.files_train,
            "files_heldout": corpus.files_heldout,
            "train_tokens": len(train_stream),
            "heldout_tokens": len(heldout_stream),
            "bytes_per_token": corpus.heldout_bytes / max(1, len(heldout_stream)),
        },
        "params_main": param_count(model),
        "params_mtp": param_count(mtp),
        "disk_bytes": (out_dir / "model.safetensors").stat().st_size,
        "train": train_info,
        "eval": ev,
        "unigram_loss": uni,
        "samples": samples,
        "sample_tokens": sample_tokens,
        "total_seconds": time.monotonic() - t_start,
        "mtp_loss_weight": MTP_LOSS_WEIGHT,
    }
    write_readme(out_dir, info)
    log(json.dumps({k: info[k] for k in ("eval", "unigram_loss", "params_main", "params_mtp", "disk_bytes")}, indent=1))
    return info


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output model directory")
    parser.add_argument("--minutes", type=float, default=25.0, help="training time budget")
    parser.add_argument(
        "--steps", type=int, default=None, help="number of steps (default: as many as fit in --minutes)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=TrainSettings.threads,
        help="torch threads (1 by default: on 2 cores shared with other jobs, "
        "2 OpenMP threads measured 2-10x slower per step)",
    )
    parser.add_argument("--no-amp", action="store_true", help="train in plain float32")
    parser.add_argument("--max-files", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--batch-size", type=int, default=TrainSettings.batch_size)
    parser.add_argument("--seq-len", type=int, default=TrainSettings.seq_len)
    parser.add_argument("--lr", type=float, default=TrainSettings.lr)
    parser.add_argument("--save-dtype", default=TrainSettings.save_dtype, choices=("float32", "float16", "bfloat16"))
    args = parser.parse_args(argv)
    s = TrainSettings(
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        lr=args.lr,
        steps=args.steps,
        minutes=args.minutes,
        seed=args.seed,
        threads=args.threads,
        save_dtype=args.save_dtype,
        amp=not args.no_amp,
    )
    command = "python -m tools.training.train_default " + " ".join(sys.argv[1:] if argv is None else argv)
    run(Path(args.out), s, command, max_files=args.max_files)


if __name__ == "__main__":
    main()
