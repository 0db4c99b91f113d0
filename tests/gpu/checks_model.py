"""Stage (b) of the device checks: whole tiny models, greedy tokens on the GPU equal the CPU's.

Both tiny families (Qwen3-Next: GDN + gated attention of head dim 32, one FlashInfer is not
built for, so attention takes the Triton kernel; Granite-4.0-H: Mamba2 + attention) are built
with the transformers of the machine (5.17 on the GPU box: only its config and model classes
are used) and run by our engine in one process: on CUDA with the ``auto`` backend, every
torch reference made to raise (so every op, attention included, ran its Triton kernel),
against the CPU with the torch references, both fp32; then bf16 on CUDA against the torch
references on CUDA; then Qwen3-Next with MTP speculation (verify kernels with per-token
states). A second round of prompts shares the first's long prefix, so prefix-cache hits
resume from checkpoints the kernels wrote.

Two kernels may split a near-tie differently, so one divergence per sequence is accepted
(the sequence is not compared past it): in fp32 where the reference's top-2 logprobs are
within ``tie`` of each other (tf32 dots in the chunked GDN kernel); in bf16 where each run's
token is in the other's top-5 (vLLM's ``check_logprobs_close``). bf16 logits come out of a
bf16 lm-head, in steps of 1/64 at this model's magnitudes, and two bf16 formulations of the
model differ by several steps: on the CPU, the Triton kernels (interpreter) against the torch
references, both bf16, diverged in all five sequences, at top-2 gaps of 0.016 to 0.08 (one in
a three-way tie: the kernels' top-2 tied, without the reference's token), so a fixed gap is no
test of bf16.
"""

from __future__ import annotations

import tempfile
import traceback
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import kernels.attention
import kernels.conv1d
import kernels.gdn
import kernels.norm
import kernels.ssd
from kernels import backend
from tests.gpu.common import Deadline, Report

STEM = "The quick brown fox jumps over the lazy dog while the cat sleeps on a warm mat. "


def prompts(dry_run: bool) -> list[list[str]]:
    """Two rounds; the second shares the first's long prompt (> 16 tokens: the chunked
    kernels). The interpreter is slow: a shorter stem and fewer tokens in a dry run."""
    stem = STEM if dry_run else STEM * 3
    return [["Hello there", "a", stem], [stem + "and then", stem + "or not"]]


MAX_TOKENS, DRY_RUN_TOKENS = 16, 4
TOP = 5  # logprobs returned per token: the bf16 rule's top-k
TORCH_REFS = [
    (kernels.gdn, "gated_delta_rule_torch"),
    (kernels.ssd, "ssd_torch"),
    (kernels.conv1d, "causal_conv1d_torch"),
    (kernels.norm, "rms_norm_torch"),
    (kernels.norm, "gated_rms_norm_torch"),
    (kernels.attention, "paged_attention_torch"),
]
COLUMNS = ["model", "run", "against", "tokens equal", "first divergence", "result"]


class Run(NamedTuple):
    device: str
    dtype: str
    backend: str  # "auto" / "triton": the kernels (references forbidden); "torch"
    spec: bool = False


class Outcome(NamedTuple):
    equal: int  # tokens compared equal before the first divergence (or all)
    total: int
    divergence: str  # "" when none, else where and the reference's top-2 gap
    ok: bool


def _forbidden(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("a torch reference ran on the kernel path")


@contextmanager
def kernels_only() -> Iterator[None]:
    """Every torch reference the dispatchers could fall back to raises while inside."""
    saved = [(module, name, getattr(module, name)) for module, name in TORCH_REFS]
    for module, name, _ in saved:
        setattr(module, name, _forbidden)
    try:
        yield
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


def generate(model_dir: Path, run: Run, dry_run: bool = False) -> list[Any]:
    from workers.llm import LLM
    from workers.sampling.params import SamplingParams

    spec = {"method": "mtp", "num_draft_tokens": 2} if run.spec else {"method": "none"}
    params = SamplingParams(
        max_tokens=DRY_RUN_TOKENS if dry_run else MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=TOP
    )
    with ExitStack() as stack:
        stack.enter_context(backend.use_backend(run.backend))
        if run.backend != "torch":
            stack.enter_context(kernels_only())
        llm = LLM(
            model=str(model_dir),
            device=run.device,
            dtype=run.dtype,
            spec=spec,
            cache={"page_size": 16, "max_kv_tokens": 8192, "mamba_track_interval": 16},
        )
        try:
            return [out for batch in prompts(dry_run) for out in llm.generate(batch, params)]
        finally:
            llm.engine.runner.shutdown()


def compare_greedy(got: list[Any], want: list[Any], tie: float | None) -> Outcome:
    equal = total = 0
    for g, w in zip(got, want):
        total += len(w.token_ids)
        if g.cached_tokens != w.cached_tokens:
            return Outcome(
                equal, total, f"cached tokens {g.cached_tokens} vs {w.cached_tokens} for {w.prompt[:20]!r}", False
            )
        for i, (a, b) in enumerate(zip(g.token_ids, w.token_ids)):
            if a == b:
                equal += 1
                continue
            top = w.logprobs[i].top
            gap = top[0][1] - top[1][1]
            if tie is None:  # bf16: each token in the other's top-5
                ok = a in {t for t, _ in top} and b in {t for t, _ in g.logprobs[i].top}
            else:
                ok = gap <= tie
            return Outcome(equal, total, f"token {i} of {w.prompt[:20]!r}: {a} vs {b}, top-2 gap {gap:.2g}", ok)
    return Outcome(equal, total, "", len(got) == len(want))


def cases(dry_run: bool) -> list[tuple[str, Run, Run, float | None]]:
    """(model, run, reference, tie): the kernels on the device against the torch path
    (``tie`` None: the top-5 rule of bf16).

    A dry run (CPU, interpreter) takes the MTP case alone: the others run the same code, and
    ``tests/kernels/triton_path/test_model_triton.py`` runs both families that way already.
    """
    mtp = (
        "qwen3_next+mtp",
        Run("cpu" if dry_run else "cuda", "float32", "triton" if dry_run else "auto", spec=True),
        Run("cpu", "float32", "torch", spec=True),
        1e-2,
    )
    if dry_run:
        return [mtp]
    archs = ("qwen3_next", "granitemoehybrid")
    fp32 = [(arch, Run("cuda", "float32", "auto"), Run("cpu", "float32", "torch"), 1e-2) for arch in archs]
    bf16 = [(arch, Run("cuda", "bfloat16", "auto"), Run("cuda", "bfloat16", "torch"), None) for arch in archs]
    return fp32 + [mtp] + bf16


def run(report: Report, deadline: Deadline, dry_run: bool) -> None:
    from tools.tiny import make_tiny_checkpoint

    root = Path(tempfile.mkdtemp(prefix="hybridserve-model-check-"))
    dirs: dict[str, Path] = {}
    for name, run_, ref, tie in cases(dry_run):
        label, against = _label(run_), _label(ref)
        if deadline.passed():
            report.row(name, label, against, None, "skipped: stage time limit", None, ok=False)
            continue
        try:
            arch = name.split("+")[0]
            if name not in dirs:
                dirs[name] = make_tiny_checkpoint(arch, root / name, seed=0, mtp="+mtp" in name)
            got, want = generate(dirs[name], run_, dry_run), generate(dirs[name], ref, dry_run)
            res = compare_greedy(got, want, tie)
        except Exception as exc:  # report it and go on with the next case
            traceback.print_exc()
            report.row(name, label, against, None, f"{type(exc).__name__}: {exc}"[:160], None, ok=False)
            continue
        report.row(name, label, against, f"{res.equal}/{res.total}", res.divergence or "none", res.ok, ok=res.ok)


def _label(run: Run) -> str:
    kind = "kernels" if run.backend != "torch" else "torch refs"
    return f"{run.device} {run.dtype} {kind}" + (" mtp k=2" if run.spec else "")
