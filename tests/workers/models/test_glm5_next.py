"""GLM-5.3-Flash (``workers/models/glm5_next.py``) beyond the registry suite: the fields refused
by name, speculation refused (transformers does not run the released MTP layer), the released
MTP tensors skipped and transformers' runtime names loading to the same model, the vision
tower skipped, and the indexer really selecting a subset on the tiny config (else the
transformers equality would not test it).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.workers.engine.helpers import make_llm
from tests.workers.models.harness import Harness, random_prompts
from tools.tiny import tiny_config
from workers.loader import load_model
from workers.models.dsa import KPoolIndexer
from workers.models.glm5_next import Glm5NextForConditionalGeneration

FAMILY = "glm5_next"
REFUSED = {
    "act": ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    "rope": ({"qk_rope_head_dim": 8}, "qk_rope_head_dim=8"),
    "kv_heads": ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
    "swiglu_limit": ({"swiglu_limit": 0.0}, "swiglu_limit=0.0"),
    "index_topk": ({"index_topk": 6}, "index_topk=6"),
    "index_topk_zero": ({"index_topk": 0}, "index_topk=0"),
    "no_tail": ({"index_kpool_always_select_tail": False}, "index_kpool_always_select_tail=False"),
    "hc_mult": ({"hc_mult": 0}, "hc_mult=0"),
    "sinkhorn": ({"hc_sinkhorn_iters": 0}, "hc_sinkhorn_iters=0"),
    "shared_first": ({"indexer_types": ["full", "shared", "full", "full", "full"]}, r"indexer_types\[1\]='shared'"),
    "shared_after_kda": ({"indexer_types": ["full", "full", "full", "full", "shared"]}, r"indexer_types\[4\]"),
    "layer_kind": (
        {"layer_types": ["linear_attention", "sliding_attention", "linear_attention"] + ["linear_attention"] * 2},
        "layer_types=",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unserved_fields_are_refused_by_name(case: str) -> None:
    overrides, message = REFUSED[case]
    cfg = tiny_config(FAMILY, 512, 0)
    for field, value in overrides.items():  # set after construction: transformers refuses some itself
        setattr(cfg.text_config, field, value)
    with pytest.raises(ValueError, match=message):
        Glm5NextForConditionalGeneration(cfg, torch.float32, "meta")


def test_speculation_is_refused(tiny_checkpoint) -> None:
    with pytest.raises(ValueError, match="spec.method 'mtp'.*Glm5NextForConditionalGeneration has none"):
        make_llm(tiny_checkpoint(FAMILY), spec={"method": "mtp", "num_draft_tokens": 2})


def test_the_batch_invariant_mode_is_refused_at_start_up(tiny_checkpoint) -> None:
    with pytest.raises(ValueError, match="deterministic is not supported for Glm5NextForConditionalGeneration"):
        make_llm(tiny_checkpoint(FAMILY), deterministic=True)


def _prefill_logits(model_dir: Path) -> list[torch.Tensor]:
    model = load_model(model_dir, torch.float32, "cpu").model
    return Harness(model).prefill(random_prompts(model.config.vocab_size, [5, 23], seed=4))


def _runtime_name(name: str) -> str:
    """A released (saved) name -> transformers' in-memory one."""
    for part in ("fn", "base", "scale"):
        for block in ("attn", "ffn"):
            name = name.replace(f".hc_{block}_{part}", f".{block}_hc.{part}")
    for gate in ("A_log", "dt_bias", "f_a_proj.", "f_b_proj."):
        name = name.replace(f".self_attn.{gate}", f".self_attn.forget_gate.{gate}")
    return name


def test_runtime_names_and_the_released_mtp_layer_load_to_the_same_model(tiny_checkpoint, tmp_path) -> None:
    """transformers' runtime layout (``attn_hc.*``, ``forget_gate.*``, one ``conv1d``, fused
    experts) loads as the saved one; the MTP layer after the last layer is skipped."""
    src = tiny_checkpoint(FAMILY)
    dst = Path(shutil.copytree(src, tmp_path / "runtime"))
    tensors = load_file(str(dst / "model.safetensors"))
    assert any(n.startswith("model.visual.") for n in tensors)
    out: dict[str, torch.Tensor] = {}
    convs: dict[str, list[torch.Tensor]] = {}
    experts: dict[str, dict[str, list[torch.Tensor]]] = {}
    for name, t in sorted(tensors.items()):
        name = _runtime_name(name)
        if name.endswith(("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")):
            convs.setdefault(name.rsplit(".", 2)[0], []).append((name, t))  # type: ignore[arg-type]
        elif ".experts." in name:
            prefix, rest = name.split(".experts.")
            expert, part = rest.split(".")[:2]
            experts.setdefault(prefix, {}).setdefault(part, []).append((int(expert), t))  # type: ignore[arg-type]
        else:
            out[name] = t
    for module, parts in convs.items():
        ordered = dict(parts)
        out[f"{module}.conv1d.weight"] = torch.cat([ordered[f"{module}.{p}_conv1d.weight"] for p in "qkv"])
    for prefix, parts in experts.items():
        gate, up, down = ([t for _, t in sorted(parts[p])] for p in ("gate_proj", "up_proj", "down_proj"))
        out[f"{prefix}.experts.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
        out[f"{prefix}.experts.down_proj"] = torch.stack(down)
    num_layers = json.loads((dst / "config.json").read_text())["text_config"]["num_hidden_layers"]
    out[f"model.language_model.layers.{num_layers}.eh_proj.weight"] = torch.zeros(4, 4)
    out["model.language_model.layers.1.shared_head.norm.weight"] = torch.zeros(4)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for a, b in zip(_prefill_logits(src), _prefill_logits(dst)):
        assert torch.equal(a, b)


def test_the_indexer_selects_a_subset(tiny_checkpoint, monkeypatch) -> None:
    """On the tiny config (blocks of 4, 2 kept) a 70-token prompt's later rows attend to fewer
    positions than they see, and different rows pick different blocks."""
    model = load_model(tiny_checkpoint(FAMILY), torch.float32, "cpu").model
    seen: list[torch.Tensor] = []
    forward = KPoolIndexer.forward

    def recording(self, *args, **kwargs):
        positions = forward(self, *args, **kwargs)
        seen.append(positions.clone())
        return positions

    monkeypatch.setattr(KPoolIndexer, "forward", recording)
    Harness(model).prefill(random_prompts(model.config.vocab_size, [70], seed=5))
    assert len(seen) == 2  # layers 1 and 4; layer 2 shares layer 1's selection
    for positions in seen:
        counts = (positions >= 0).sum(-1)
        assert counts[:8].tolist() == list(range(1, 9))  # up to 2 blocks: everything
        assert int(counts[12:].max()) <= 2 * 4 + 3 < 13
        chosen = {
            tuple(sorted({int(p) // 4 for p in row if 0 <= p < (i + 1) // 4 * 4})) for i, row in enumerate(positions)
        }
        assert len(chosen) > 10, "rows choose different blocks"


def test_cache_spec_keeps_latent_and_indexer_rows(tiny_checkpoint) -> None:
    """KDA on layers 0 and 3, MLA latents [1, R] (no rope part) on 1, 2, 4, and the indexer's
    [k | gate] rows only where a full indexer runs (layers 1 and 4; layer 2 shares)."""
    spec = load_model(tiny_checkpoint(FAMILY), torch.float32, "meta").model.cache_spec()
    assert {g.kind.name: g.num_layers for g in spec.groups} == {"kda": 2, "mla": 3, "indexer": 2}
    indexer = spec.group("indexer")
    assert indexer is not None and indexer.kind.paged
    assert [(t.name, t.shape, t.replicated) for t in indexer.kind.tensors] == [("keys", (1, 32), True)]
    assert spec.bytes_per_token(torch.float32) == 4 * (3 * 32 + 2 * 32)
