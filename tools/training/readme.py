"""The default model's README.md: how it was made and its held-out numbers, from the ``info``
dict that ``train_default.run`` collects (settings, data sizes, eval results, samples)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def write_readme(out_dir: Path, info: dict[str, Any]) -> None:
    parts = (_intro(), _how_made(info), _results(info), _samples(info))
    (out_dir / "README.md").write_text("\n".join(parts))


def _intro() -> str:
    return """# qwen3-next-tiny-py

The default model of hybridserve: a tiny **Qwen3-Next** (`Qwen3NextForCausalLM`: Gated
DeltaNet + gated full attention, MoE with a shared expert, zero-centred RMSNorms, partial
RoPE) **with an MTP head** (`mtp.*`), trained from scratch on CPU on the Python standard
library's own source. It writes Python-looking code and nothing else; it is a test and
demo model, not an assistant.
"""


def _how_made(info: dict[str, Any]) -> str:
    s, d = info["settings"], info["data"]
    return f"""## How it was made

```
{info["command"]}
```

(`tools/training/train_default.py`; seeds fixed; Python {info["python"]}, torch
{info["torch"]}, transformers {info["transformers"]}, {info["threads"]} CPU threads.)

- **Data**: {d["files_train"]} training and {d["files_heldout"]} held-out
  `.py` files of the stdlib at `sysconfig.get_paths()["stdlib"]` (held-out = sha256 of the
  relative path, first 4 bytes mod 100 < {s["heldout_percent"]}; site-packages, `encodings/`,
  `pydoc_data/`, `lib2to3/tests/data/`, `_sysconfigdata*` and files over 400 kB left out).
  {d["train_tokens"]:,} training tokens, {d["heldout_tokens"]:,} held-out tokens
  ({d["bytes_per_token"]:.2f} bytes/token on held-out text).
- **Tokenizer**: byte-level BPE trained with `tokenizers` on the training files, vocab
  {info["vocab"]}; `<|endoftext|>` (id 0, eos and pad), `<|im_start|>`, `<|im_end|>`; ChatML
  chat template. Pre-token split: a word or punctuation run keeps one *trailing* space
  (`def `, `= `), newlines + indentation are separate pieces, so prompts that end in a
  space (`def `) stay in the training distribution.
{_model(info)}
{_training(info)}
"""


def _model(info: dict[str, Any]) -> str:
    shape = info["settings"]["shape"]
    total = info["params_main"] + info["params_mtp"]
    return f"""- **Model**: hidden {shape["hidden_size"]}, {4 * shape["num_blocks"]} layers
  (`[linear_attention x3, full_attention] x {shape["num_blocks"]}`);
  GDN {shape["linear_num_key_heads"]} key / {shape["linear_num_value_heads"]} value heads of
  dim {shape["linear_key_head_dim"]}; attention {shape["num_attention_heads"]} heads /
  {shape["num_key_value_heads"]} KV heads, head_dim {shape["head_dim"]}, partial rotary 0.25; dense SwiGLU
  ({shape["intermediate_size"]}) after the GDN layers, MoE after the attention layers
  ({shape["num_experts"]} experts of {shape["moe_intermediate_size"]}, top-{shape["num_experts_per_tok"]}, +
  a sigmoid-gated shared expert of {shape["shared_expert_intermediate_size"]}); tied embeddings.
  MTP head: `fc` 2H→H over
  concat[`pre_fc_norm_embedding`(e_{{t+1}}), `pre_fc_norm_hidden`(h_t)], one full-attention MoE
  decoder layer (RoPE at position t+1), `norm`, the shared `lm_head`.
- **Parameters**: {info["params_main"]:,} main + {info["params_mtp"]:,} MTP = {total:,}
  ({info["disk_bytes"] / 1e6:.2f} MB `model.safetensors`, stored as {info["settings"]["save_dtype"]};
  load it as float32)."""


def _training(info: dict[str, Any]) -> str:
    s, t = info["settings"], info["train"]
    amp = ", bfloat16 autocast for the matmuls" if s["amp"] else ""
    return f"""- **Training**: loss = CE(next token) + {info["mtp_loss_weight"]}·CE(MTP, token t+2) +
  0.001·router balance loss; AdamW (β 0.9/0.95, weight decay {s["weight_decay"]} on matrices),
  peak lr {s["lr"]}, {s["warmup_steps"]} warmup steps then cosine to {s["min_lr_ratio"]}×;
  batch {s["batch_size"]} × {s["seq_len"]} tokens
  (random windows of the token stream, files joined by `<|endoftext|>`); gradient clip {s["grad_clip"]};
  float32 weights{amp}.
  {t["steps"]} steps, {t["tokens_seen"]:,} tokens, **{t["train_seconds"] / 60:.1f} min** of
  training ({info["total_seconds"] / 60:.1f} min for the whole script, data and tokenizer included)."""


def _results(info: dict[str, Any]) -> str:
    s, ev = info["settings"], info["eval"]
    loss, uni = ev["heldout_loss"], info["unigram_loss"]
    bits_per_byte = loss / math.log(2) / info["data"]["bytes_per_token"]
    hist = "\n".join(f"| {st} | {sec} | {m} | {mt} |" for st, sec, m, mt in info["train"]["history"])
    return f"""## Held-out results

Measured on {ev["eval_tokens"]:,} tokens ({s["eval_windows"]} fixed windows of {s["seq_len"]}) of the held-out
files, with the weights as saved ({s["save_dtype"]}, computed in float32):

| metric | value |
|---|---|
| held-out loss (next token, nats/token) | **{loss:.3f}** (ppl {math.exp(loss):.1f}) |
| unigram baseline (add-one train frequencies) | {uni:.3f} (ppl {math.exp(uni):.0f}) |
| held-out bits per byte | {bits_per_byte:.3f} |
| next-token top-1 accuracy | {ev["main_top1"]:.3f} |
| MTP loss (token t+2, nats/token) | {ev["heldout_mtp_loss"]:.3f} |
| MTP top-1 accuracy (token t+2) | {ev["mtp_top1"]:.3f} |
| **MTP acceptance** (greedy draft = main model's greedy token) | **{ev["mtp_acceptance"]:.3f}** |

MTP acceptance is the fraction of held-out positions t where the MTP head's argmax from
(h_t, true token t+1) equals the main model's argmax at t+1 given the true prefix, i.e. the
acceptance rate of a one-token greedy draft.

Training curve (training-batch losses):

| step | seconds | main CE | MTP CE |
|---|---|---|---|
{hist}
"""


def _samples(info: dict[str, Any]) -> str:
    samples = "\n\n".join(f"Prompt `{json.dumps(p)}`:\n\n```python\n{text}\n```" for p, text in info["samples"].items())
    return f"""## Greedy samples

Greedy (temperature 0) continuations, {info["sample_tokens"]} new tokens:

{samples}
"""


DISTILL_HEADING = "## Distilled MTP head"
_SAMPLES_HEADING = "## Greedy samples"


def write_distill_section(out_dir: Path, info: dict[str, Any]) -> None:
    """Put (or replace) the "Distilled MTP head" section of an existing README, from the
    ``info`` that ``distill_mtp.run`` collects, before the greedy samples (which it does
    not change: the main model is untouched)."""
    put_section(out_dir / "README.md", DISTILL_HEADING, _distill(info))


def put_section(path: Path, heading: str, section: str) -> None:
    """Replace the README's section ``heading`` (to the next "## " heading) by ``section``
    (which starts with the heading), or put it before the greedy samples, or at the end."""
    text = path.read_text() if path.exists() else ""
    if heading in text:
        head, rest = text.split(heading, 1)
        tail = rest[rest.index("\n## ") + 1 :] if "\n## " in rest else ""
        text = head + section + tail
    elif _SAMPLES_HEADING in text:
        head, tail = text.split(_SAMPLES_HEADING, 1)
        text = head + section + _SAMPLES_HEADING + tail
    else:
        text = text + "\n" + section
    path.write_text(text)


def _given(j: int) -> str:
    return "" if j == 0 else " (given draft 1 accepted)" if j == 1 else f" (given drafts 1..{j} accepted)"


def _engine_table(info: dict[str, Any]) -> str:
    """The engine's acceptance before and after distillation, when measured."""
    if not (info.get("engine_before") and info.get("engine_after")):
        return ""
    eng_rows = "\n".join(
        f"| k = {k} | {info['engine_before'][k]:.3f} | **{info['engine_after'][k]:.3f}** |"
        for k in info["engine_before"]
    )
    return f"""
The engine's own acceptance (accepted ÷ drafted, `num_draft_tokens` = k, greedy, batch 1,
the bench suite's three `spec` prompts × 48 tokens, float32):

| engine | before | after |
|---|---|---|
{eng_rows}
"""


def _distill(info: dict[str, Any]) -> str:
    s, t = info["settings"], info["train"]
    before, after = info["before"], info["after"]
    rows = [
        f"| draft {j + 1}{_given(j)} | {b:.3f} | **{a:.3f}** |"
        for j, (b, a) in enumerate(zip(before["chain"]["conditional"], after["chain"]["conditional"]))
    ]
    rows.append(
        f"| accepted drafts per {s['k']}-chain (mean) | {before['chain']['mean_accepted']:.3f} | "
        f"**{after['chain']['mean_accepted']:.3f}** |"
    )
    rows.append(
        f"| one-step acceptance on held-out text (the table above's metric) | "
        f"{before['one_step_text']:.3f} | {after['one_step_text']:.3f} |"
    )
    eng = _engine_table(info)
    return f"""{DISTILL_HEADING}

The shipped `mtp.*` tensors are the head above fine-tuned alone by self-distillation from
the frozen main model (every `model.*` tensor is byte-identical to the joint training's;
the MTP rows of the table above are of the head before it):

```
{info["command"]}
```

(`tools/training/distill_mtp.py`.) Targets are the main model's own next-token
distributions (KL(main ‖ draft) + {s["hard_weight"]}·CE to its argmax), not the text; data are
training-text prompts of {s["min_prompt"]}–{s["max_prompt"]} tokens continued by the main model's greedy
decoding to {s["seq_len"]} tokens (prompt anchors weighted {s["text_weight"]}).
The {s["k"]}-step draft chain is
unrolled as the engine runs it (step j feeds the head's own previous output and token
x_{{s+j}}; its attention sees the catch-up rows ≤ s and its own chained rows), steps
weighted {", ".join(str(w) for w in s["step_weights"][: s["k"]])}.
AdamW lr {s["lr"]} (cosine to {s["min_lr_ratio"]}×), batch {s["batch_size"]};
{t["steps"]} steps, **{t["train_seconds"] / 60:.1f} min** of training, {s["threads"]} CPU thread
({info["total_seconds"] / 60:.1f} min for the whole script, evaluations included).

Held-out acceptance of greedy drafts (a draft is right when it equals the main model's
greedy token), over every position of {len(s["eval_prompts"])}×{s["eval_per_length"]} held-out prompts
(lengths {", ".join(map(str, s["eval_prompts"]))}) continued greedily to {s["seq_len"]} tokens
({after["chain"]["anchors"]:,} anchors):

| chain position | before | after |
|---|---|---|
{chr(10).join(rows)}
{eng}
"""
