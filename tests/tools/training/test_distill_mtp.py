"""Self-distillation of the MTP head (``tools.training.distill_mtp``) on a tiny random
Qwen3-Next: the unrolled chain is the engine drafter's, the loss falls, the main model's
weights and file bytes stay, the README section is replaced in place."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.tools.training.conftest import TINY_SHAPE
from tests.workers.models.test_mtp_head import mtp_harness
from tools.training import distill_mtp as dm
from tools.training import train_default as td
from tools.training.readme import write_distill_section
from workers.loader import load_model
from workers.sampling.params import SamplingParams
from workers.spec.drafter import MtpSpan


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A random tiny Qwen3-Next + MTP head (sharper init than training's), saved float32."""
    out = tmp_path_factory.mktemp("distill")
    cfg = td.hf_config(td.ModelShape(vocab_size=64, **TINY_SHAPE), eos_id=0)
    model, mtp = td.build_model(cfg, seed=0)
    mtp.init_weights(torch.Generator().manual_seed(5), std=0.2)
    td.save_model_dir(out, model, mtp, "float32")
    return out


def tiny_settings(**kw) -> dm.DistillSettings:
    base = dict(
        seq_len=24,
        min_prompt=4,
        max_prompt=8,
        batch_size=2,
        lr=1e-2,
        amp=False,
        steps=20,
        minutes=2.0,
        warmup_steps=1,
        eval_prompts=(4, 8),
        eval_per_length=2,
        text_eval_len=32,
    )
    return dm.DistillSettings(**{**base, **kw})


def engine_chain(model_dir: Path, prompt: list[int], next_token: int, k: int):
    """The engine's drafter on ``prompt`` (+ the sampled ``next_token``): (target hidden
    [n, H], drafts, every output of the head's calls: catch-up [n, H], then chain rows)."""
    model = load_model(model_dir, torch.float32, "cpu").model
    h, drafter = mtp_harness(model, num_drafts=k)
    head, calls = drafter.mtp, []

    def record(*args, **kwargs):
        out = head(*args, **kwargs)
        calls.append(out.clone())
        return out

    drafter.mtp = record
    with torch.inference_mode():
        hidden = model(h.make_batch([(0, prompt)]), h.pools)
        seq = h.seqs[0]
        pages = seq.pages + [h.free_pages.pop() for _ in range(-(-k // h.page_size))]  # chained rows
        drafter.run(
            [
                MtpSpan(
                    0,
                    hidden,
                    torch.tensor(prompt[1:] + [next_token]),
                    pages,
                    seq.slot,
                    "r",
                    SamplingParams(max_tokens=4, temperature=0.0),
                    None,
                )
            ]
        )
    return hidden, drafter.draft_tokens[seq.slot].tolist(), calls


def test_unrolled_chain_is_the_engine_drafters(tiny_dir) -> None:
    """Step 1 = the catch-up rows; steps 2, 3 at the last anchor = the engine's chained rows
    (the head fed its own post-norm output, the draft token, the next position, attending
    to the catch-up KV and its own chained rows only)."""
    k, prompt, nxt = 3, [5, 9, 17, 3, 40, 22, 8, 13, 31, 2, 60, 7], 11
    hidden, drafts, calls = engine_chain(tiny_dir, prompt, nxt, k)
    assert len(calls) == k
    model, mtp = td.load_saved(tiny_dir)
    tokens = torch.tensor([prompt + [nxt] + drafts[: k - 1]])
    with torch.no_grad():
        outs = dm.unroll_chain(model, mtp, hidden[None], tokens, k)
    n = len(prompt)
    torch.testing.assert_close(outs[0][0], calls[0], atol=2e-5, rtol=1e-4)
    for j in range(1, k):
        torch.testing.assert_close(outs[j][0, n - 1], calls[j][0], atol=2e-5, rtol=1e-4)
    assert [int(model.lm_head(o[0, n - 1]).argmax()) for o in outs] == drafts


def test_chain_mask_rows() -> None:
    m = dm.chain_mask(3, 3)
    assert m.shape == (3, 9)
    seen = (m == 0).int().tolist()
    assert seen == [[1, 0, 0, 1, 0, 0, 1, 0, 0], [1, 1, 0, 0, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 1, 0, 0, 1]]


def test_distillation_lowers_the_loss_and_keeps_the_main_model(tiny_dir, tmp_path) -> None:
    torch.manual_seed(0)
    s = tiny_settings(hard_weight=0.0)  # the loss is then KL(main || draft) alone
    model, mtp = td.load_saved(tiny_dir)
    before = dm.main_state(model)
    stream = torch.arange(600) % 11 + 3
    seqs, p = dm.sample_batch(model, stream, s, torch.Generator().manual_seed(9))
    first = dm.distill_loss(model, mtp, seqs, p, s).loss.item()
    info = dm.train_head(model, mtp, stream, s, log=lambda *a: None)
    assert info["steps"] == 20
    last = dm.distill_loss(model, mtp, seqs, p, s).loss.item()
    assert last < 0.5 * first, (first, last)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    ckpt = tmp_path / "m"
    shutil.copytree(tiny_dir, ckpt)
    dm.save_head(ckpt, model, mtp, before)
    old, new = load_file(str(tiny_dir / "model.safetensors")), load_file(str(ckpt / "model.safetensors"))
    assert old.keys() == new.keys()
    assert all(torch.equal(old[k], new[k]) for k in old if not k.startswith("mtp."))
    assert not torch.equal(old["mtp.fc.weight"], new["mtp.fc.weight"])
    assert (ckpt / "model.safetensors").stat().st_mode & 0o777 == 0o644  # as it was
    with torch.no_grad():
        next(model.parameters()).add_(1e-3)
    with pytest.raises(RuntimeError, match="main-model tensors changed"):
        dm.save_head(ckpt, model, mtp, before)


def test_chain_acceptance_counts(tiny_dir) -> None:
    s = tiny_settings()
    model, mtp = td.load_saved(tiny_dir)
    batches = dm.eval_sequences(model, torch.arange(600) % 11 + 3, s)
    assert [b.shape for b, _ in batches] == [(2, 24), (2, 24)]
    ev = dm.chain_acceptance(model, mtp, batches, s.k)
    assert ev["anchors"] == 2 * (21 - 3) + 2 * (21 - 7)
    assert all(0.0 <= c <= 1.0 for c in ev["conditional"]) and 0 <= ev["mean_accepted"] <= s.k


def test_readme_section_is_replaced_in_place(tmp_path) -> None:
    (tmp_path / "README.md").write_text("# m\n\n## Held-out results\n\nx\n\n## Greedy samples\n\ny\n")
    chain = {"anchors": 10, "conditional": [0.5, 0.4, 0.3], "mean_accepted": 0.9}
    info = {
        "command": "c",
        "settings": {**vars(tiny_settings())},
        "total_seconds": 60.0,
        "train": {"steps": 3, "train_seconds": 30.0},
        "engine_before": {1: 0.5},
        "engine_after": {1: 0.6},
        "before": {"chain": chain, "one_step_text": 0.2},
        "after": {"chain": {**chain, "conditional": [0.9, 0.8, 0.7]}, "one_step_text": 0.3},
    }
    write_distill_section(tmp_path, info)
    write_distill_section(tmp_path, info)
    text = (tmp_path / "README.md").read_text()
    assert text.count("## Distilled MTP head") == 1 and text.endswith("## Greedy samples\n\ny\n")
    assert "| draft 3 (given drafts 1..2 accepted) | 0.300 | **0.700** |" in text
    assert "| k = 1 | 0.500 | **0.600** |" in text


@pytest.mark.parametrize("engine_check", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_run_rewrites_only_the_head_and_the_readme(trained, tmp_path, engine_check) -> None:
    """The script end to end on the tiny trained dir: evaluations before/after (the
    engine's too, in the slow variant), main tensors byte-identical, README section."""
    ckpt = tmp_path / "m"
    shutil.copytree(trained[0], ckpt)
    old = load_file(str(ckpt / "model.safetensors"))
    info = dm.run(ckpt, tiny_settings(steps=3), "cmd", log=lambda *a: None, max_files=12, engine_check=engine_check)
    new = load_file(str(ckpt / "model.safetensors"))
    assert all(torch.equal(old[k], new[k]) for k in old if k.startswith("model."))
    assert info["train"]["steps"] == 3
    readme = (ckpt / "README.md").read_text()
    assert readme.index("## Distilled MTP head") < readme.index("## Greedy samples")
    if engine_check:
        assert set(info["engine_after"]) == {1, 2, 3}
        assert all(0.0 <= a <= 1.0 for a in info["engine_after"].values())
        assert "| k = 3 |" in readme
