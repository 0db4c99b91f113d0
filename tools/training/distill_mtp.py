"""Self-distil the MTP head of a trained model dir from its frozen main model (EAGLE-style).

    python -m tools.training.distill_mtp --model configs/models/qwen3-next-tiny-py --minutes 20

Only ``mtp.*`` is trained; every ``model.*`` tensor is written back byte for byte (asserted,
and the main model's logits are checked unchanged after the save). A draft is accepted when
it equals the *main model's* greedy token, so the targets are the main model's own
next-token distributions (KL(main || draft), plus ``hard_weight`` x CE to its argmax),
not the text.

Data: a window of the training text (``prompt_len`` tokens, random per batch) continued by
the main model's own greedy decoding up to ``seq_len`` tokens, as the engine's sequences
are (prompt + greedy output). On such a sequence the tokens after the prompt *are* the
main model's greedy tokens, i.e. the drafts whenever the earlier drafts were accepted.

The chain is trained as ``workers.spec.drafter`` runs it (``unroll_chain``). For anchor s
(the last row a catch-up computed), step j = 1..k runs one MTP row at RoPE position s + j
(the engine uses s + j - 1: RoPE is relative, the shift changes nothing) on

    step 1:  hidden = the main model's final-normed h_s,      token x_{s+1}
    step j:  hidden = step j-1's output (after ``mtp.norm``), token x_{s+j}

and predicts x_{s+j+1}, target: the main model's distribution at s + j. Its attention sees
the step-1 rows of positions <= s (the catch-up KV) and its own anchor's rows of steps
2..j (the chained rows' KV), never another anchor's chained rows. Loss weights: step j by
``step_weights[j-1]``; anchors from the prompt's last token on (where the engine drafts) 1,
earlier anchors (text, teacher-forced) ``text_weight``.

Evaluation (``chain_acceptance``): on fixed held-out prompts continued greedily, for every
anchor from the prompt's last token on, whether drafts 1..j all equal the main model's
greedy tokens; acceptance at position j = P(draft j right | drafts < j right).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tools.training import train_default as td
from tools.training.corpus import encode_stream, read_corpus, stdlib_files, stdlib_root
from tools.training.mtp_head import TrainableMtpHead
from tools.training.readme import write_distill_section

SUITE_WORKLOAD = Path(__file__).resolve().parents[2] / "configs" / "workloads" / "suite.yaml"


@dataclass
class DistillSettings:
    minutes: float = 20.0
    steps: int | None = None  # None: as many as fit in minutes
    k: int = 3  # chain steps unrolled (the engine's num_draft_tokens)
    step_weights: tuple[float, ...] = (1.0, 0.8, 0.64)
    hard_weight: float = 0.5  # CE to the main model's argmax, beside the soft CE
    text_weight: float = 0.2  # weight of anchors inside the prompt text
    seq_len: int = 192
    min_prompt: int = 8
    max_prompt: int = 128
    batch_size: int = 8
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    amp: bool = True  # bfloat16 autocast for the head (main model: float32)
    seed: int = 0
    threads: int = 1
    eval_prompts: tuple[int, ...] = (16, 48, 96)  # held-out prompt lengths, 16 prompts each
    eval_per_length: int = 16
    text_eval_len: int = 256  # train_default's one-step metric: 64 windows of this
    heldout_percent: int = 3

    def __post_init__(self) -> None:
        if self.k < 1 or len(self.step_weights) < self.k:
            raise ValueError(f"k={self.k} needs >= 1 and {self.k} step_weights, got {len(self.step_weights)}")
        if not 1 <= self.min_prompt <= self.max_prompt <= self.seq_len - self.k - 2:
            raise ValueError(
                f"prompt lengths {self.min_prompt}..{self.max_prompt} must fit seq_len={self.seq_len} with k={self.k}"
            )


# --- the chain as the engine runs it ----------------------------------------------------------
class KvRows:
    """Keys/values of the MTP layer's rows so far (transformers' ``Cache.update`` protocol)."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(
        self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, kwargs: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k is not None and self.v is not None:
            k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        self.k, self.v = k, v
        return k, v


def chain_mask(t: int, j: int, device: torch.device | None = None) -> torch.Tensor:
    """[t, j*t] additive mask of step j's rows: step-1 keys at anchors <= s, then the own
    anchor's key in each of steps 2..j."""
    neg = float("-inf")
    causal = torch.full((t, t), neg, device=device).triu(1)
    own = torch.full((t, t), neg, device=device)
    own.fill_diagonal_(0.0)
    return torch.cat([causal] + [own] * (j - 1), dim=1)


def unroll_chain(
    model, mtp: TrainableMtpHead, hidden: torch.Tensor, tokens: torch.Tensor, k: int
) -> list[torch.Tensor]:
    """hidden [B, T, H]: the main model's final-normed h_s; tokens [B, T + k]: x_s (token
    x_{s+j} feeds step j of anchor s). -> k outputs [B, T, H] (after ``mtp.norm``); lm_head
    of output j at anchor s drafts x_{s+j+1}. See the module docstring."""
    b, t = hidden.shape[:2]
    if tokens.shape[1] != t + k:
        raise ValueError(f"tokens has {tokens.shape[1]} columns, expected T + k = {t + k}")
    cache, prev, outs = KvRows(), hidden, []
    base = torch.arange(t, device=hidden.device).unsqueeze(0).expand(b, -1)
    for j in range(1, k + 1):
        emb = model.model.embed_tokens(tokens[:, j : j + t])
        prev = mtp.rows(prev, emb, base + j, chain_mask(t, j, hidden.device), cache)
        outs.append(prev)
    return outs


# --- data: prompts continued by the main model's greedy decoding --------------------------------
@torch.no_grad()
def greedy_continue(model, prompts: torch.Tensor, total: int) -> torch.Tensor:
    """prompts [B, P] -> [B, total]: the main model's greedy tokens appended (EOS included,
    nothing stops it, as with ``ignore_eos``)."""
    seq, out = prompts, model(input_ids=prompts, use_cache=True)
    while seq.shape[1] < total:
        nxt = out.logits[:, -1:].argmax(-1)
        seq = torch.cat([seq, nxt], dim=1)
        if seq.shape[1] < total:
            out = model(input_ids=nxt, cache=out.cache, use_cache=True)
    return seq


@torch.no_grad()
def main_targets(model, seqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(final-normed hidden [B, L, H], logits [B, L, V]) of the frozen main model, float32."""
    hidden = model.model(input_ids=seqs, use_cache=False).last_hidden_state
    return hidden, model.lm_head(hidden).float()


def anchor_weights(t: int, prompt_len: int, text_weight: float) -> torch.Tensor:
    """[T]: 1 from the prompt's last token on (the engine's anchors), else text_weight."""
    w = torch.full((t,), float(text_weight))
    w[prompt_len - 1 :] = 1.0
    return w


# --- loss and training ------------------------------------------------------------------------
@dataclass
class DistillOut:
    loss: torch.Tensor
    step_loss: list[float]
    step_accept: list[float]  # per step: argmax == main argmax, engine anchors only


def distill_loss(model, mtp: TrainableMtpHead, seqs: torch.Tensor, prompt_len: int, s: DistillSettings) -> DistillOut:
    k, t = s.k, seqs.shape[1] - s.k
    hidden, logits = main_targets(model, seqs)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=s.amp):
        outs = unroll_chain(model, mtp, hidden[:, :t], seqs, k)
    w = anchor_weights(t, prompt_len, s.text_weight).expand(seqs.shape[0], -1)
    loss = torch.zeros(())
    step_loss, step_accept = [], []
    for j, out in enumerate(outs, start=1):
        target = logits[:, j : j + t]
        logp = F.log_softmax(model.lm_head(out.float()), dim=-1)
        best, target_logp = target.argmax(-1), F.log_softmax(target, dim=-1)
        per = (target_logp.exp() * (target_logp - logp)).sum(-1)  # KL(main || draft)
        per = per - s.hard_weight * logp.gather(-1, best.unsqueeze(-1)).squeeze(-1)
        lj = (per * w).sum() / w.sum()
        loss = loss + s.step_weights[j - 1] * lj
        step_loss.append(lj.item())
        step_accept.append(float((logp.argmax(-1) == best)[:, prompt_len - 1 :].float().mean()))
    return DistillOut(loss, step_loss, step_accept)


def sample_batch(model, stream: torch.Tensor, s: DistillSettings, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    p = int(torch.randint(s.min_prompt, s.max_prompt + 1, (1,), generator=gen))
    prompts = td.sample_windows(stream, s.batch_size, p, gen)[:, :p]
    return greedy_continue(model, prompts, s.seq_len), p


def train_head(model, mtp: TrainableMtpHead, stream: torch.Tensor, s: DistillSettings, log=print) -> dict[str, Any]:
    model.eval()
    model.requires_grad_(False)
    mtp.train()
    gen = torch.Generator().manual_seed(s.seed + 3)
    opt = td.make_optimizer(model, mtp, s)  # the main model's parameters are frozen
    params = [p for g in opt.param_groups for p in g["params"]]
    budget, t0, step, history = s.minutes * 60.0, time.monotonic(), 0, []
    while True:
        elapsed = time.monotonic() - t0
        progress = elapsed / budget if s.steps is None else max(step / s.steps, elapsed / budget)
        if progress >= 1.0:
            break
        lr = td.lr_at(progress, step, s)
        for g in opt.param_groups:
            g["lr"] = lr
        seqs, p = sample_batch(model, stream, s, gen)
        out = distill_loss(model, mtp, seqs, p, s)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, s.grad_clip)
        opt.step()
        step += 1
        if step % 25 == 0 or step == 1:
            history.append((step, round(elapsed, 1), round(out.loss.item(), 4), [round(a, 3) for a in out.step_accept]))
            log(
                f"step {step} {elapsed:6.0f}s lr {lr:.2e} loss {out.loss.item():.3f} "
                f"steps {[round(x, 3) for x in out.step_loss]} acc {[round(a, 3) for a in out.step_accept]}"
            )
    mtp.eval()
    return {"steps": step, "train_seconds": round(time.monotonic() - t0, 1), "history": history}


# --- evaluation -------------------------------------------------------------------------------
def eval_sequences(model, heldout: torch.Tensor, s: DistillSettings) -> list[tuple[torch.Tensor, int]]:
    """Fixed held-out prompts (``eval_prompts`` lengths) continued greedily to ``seq_len``."""
    return [
        (greedy_continue(model, td.eval_windows(heldout, s.eval_per_length, p)[:, :p], s.seq_len), p)
        for p in s.eval_prompts
    ]


@torch.no_grad()
def chain_acceptance(model, mtp: TrainableMtpHead, batches: list[tuple[torch.Tensor, int]], k: int) -> dict[str, Any]:
    """Per chain position j: P(draft j == main greedy | drafts < j accepted), over anchors
    from each prompt's last token on; ``mean_accepted`` = E[accepted drafts of a k-chain]."""
    mtp.eval()
    anchors, right = 0, [0] * k
    for seqs, p in batches:
        t = seqs.shape[1] - k
        hidden, logits = main_targets(model, seqs)
        outs = unroll_chain(model, mtp, hidden[:, :t], seqs, k)
        ok = torch.ones(seqs.shape[0], t - (p - 1), dtype=torch.bool)
        anchors += ok.numel()
        for j, out in enumerate(outs, start=1):
            draft = model.lm_head(out).argmax(-1)
            ok = ok & (draft == logits[:, j : j + t].argmax(-1))[:, p - 1 :]
            right[j - 1] += int(ok.sum())
    prev = [anchors] + right[:-1]
    return {
        "anchors": anchors,
        "conditional": [r / max(q, 1) for r, q in zip(right, prev)],
        "mean_accepted": sum(right) / anchors,
    }


# --- the model dir ----------------------------------------------------------------------------
def main_state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def save_head(model_dir: Path, model, mtp: TrainableMtpHead, before: dict[str, torch.Tensor]) -> None:
    """Rewrite ``model.safetensors``: its ``model.*`` tensors as read, ``mtp.*`` from ``mtp``
    in the dtype the file had. Refuses if the main model's weights moved."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    moved = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    if moved:
        raise RuntimeError(f"{len(moved)} main-model tensors changed (e.g. {moved[0]}); not saving")
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    old_mtp = {k for k in tensors if k.startswith("mtp.")}
    dtype = tensors["mtp.fc.weight"].dtype
    new = mtp.checkpoint_tensors(dtype)
    if set(new) != old_mtp:
        raise RuntimeError(f"MTP tensor names differ: {sorted(set(new) ^ old_mtp)[:4]}")
    tensors.update(new)
    mode = path.stat().st_mode & 0o777  # save_file writes 0600: keep the file's mode
    save_file(dict(sorted(tensors.items())), str(path), metadata=metadata)
    path.chmod(mode)


def engine_acceptance(model_dir: Path, ks: list[int], output_len: int = 48) -> dict[int, float]:
    """The engine's acceptance (accepted / drafted drafts, greedy, batch 1) with k drafts on
    the bench suite's ``spec`` prompts (``configs/workloads/suite.yaml``)."""
    import yaml

    from workers.llm import LLM
    from workers.sampling.params import SamplingParams

    prompts = yaml.safe_load(SUITE_WORKLOAD.read_text())["spec"]["prompts"]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    out = {}
    for k in ks:
        llm = LLM(model=str(model_dir), device="cpu", dtype="float32", spec={"method": "mtp", "num_draft_tokens": k})
        for p in prompts:
            llm.generate([p], params)
        st = llm.stats()
        drafted = int(st["hybridserve_spec_draft_tokens_total"])
        out[k] = int(st["hybridserve_spec_accepted_tokens_total"]) / drafted
    return out


def run(
    model_dir: Path,
    s: DistillSettings,
    command: str,
    log=print,
    max_files: int | None = None,
    engine_check: bool = True,
) -> dict[str, Any]:
    from tokenizers import Tokenizer

    t_start = time.monotonic()
    torch.set_num_threads(s.threads)
    torch.manual_seed(s.seed)
    root = stdlib_root()
    files = stdlib_files(root)[:max_files]
    train_texts, heldout_texts = read_corpus(files, root, s.heldout_percent)
    if not heldout_texts:  # tiny test subsets: hold out the last file
        heldout_texts, train_texts = train_texts[-1:], train_texts[:-1]
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    train_stream, heldout = encode_stream(tok, train_texts), encode_stream(tok, heldout_texts)
    model, mtp = td.load_saved(model_dir)
    before_state = main_state(model)
    batches = eval_sequences(model, heldout, s)
    windows = td.eval_windows(heldout, 64, s.text_eval_len)
    ev_before = {
        "chain": chain_acceptance(model, mtp, batches, s.k),
        "one_step_text": td.evaluate(model, mtp, windows)["mtp_acceptance"],
    }
    eng_before = engine_acceptance(model_dir, list(range(1, s.k + 1))) if engine_check else None
    log(f"before: {json.dumps(ev_before)} engine {eng_before}")
    train_info = train_head(model, mtp, train_stream, s, log=log)
    save_head(model_dir, model, mtp, before_state)
    model2, mtp2 = td.load_saved(model_dir)  # numbers from the weights as saved
    probe = batches[0][0]
    with torch.no_grad():
        if not torch.equal(model2(input_ids=probe).logits, model(input_ids=probe).logits):
            raise RuntimeError("the main model's logits changed after the save")
    ev_after = {
        "chain": chain_acceptance(model2, mtp2, batches, s.k),
        "one_step_text": td.evaluate(model2, mtp2, windows)["mtp_acceptance"],
    }
    eng_after = engine_acceptance(model_dir, list(range(1, s.k + 1))) if engine_check else None
    log(f"after: {json.dumps(ev_after)} engine {eng_after}")
    info = {
        "command": command,
        "settings": asdict(s),
        "train": train_info,
        "before": ev_before,
        "after": ev_after,
        "engine_before": eng_before,
        "engine_after": eng_after,
        "total_seconds": round(time.monotonic() - t_start, 1),
    }
    write_distill_section(model_dir, info)
    return info


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model dir (rewritten in place)")
    parser.add_argument("--minutes", type=float, default=DistillSettings.minutes)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--k", type=int, default=DistillSettings.k)
    parser.add_argument("--lr", type=float, default=DistillSettings.lr)
    parser.add_argument("--seed", type=int, default=DistillSettings.seed)
    parser.add_argument("--threads", type=int, default=DistillSettings.threads)
    parser.add_argument(
        "--no-engine-check", action="store_true", help="skip the engine acceptance runs before and after"
    )
    args = parser.parse_args(argv)
    s = DistillSettings(
        minutes=args.minutes, steps=args.steps, k=args.k, lr=args.lr, seed=args.seed, threads=args.threads
    )
    command = "python -m tools.training.distill_mtp " + " ".join(sys.argv[1:] if argv is None else argv)
    run(Path(args.model), s, command, engine_check=not args.no_engine_check)


if __name__ == "__main__":
    main()
