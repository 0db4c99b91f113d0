"""Nemotron-H's MTP head (``workers/models/nemotron_h_mtp.py``): its math against
transformers' own Nemotron-H blocks, its layout (blocks, KV layers), refusals, and
speculation with heads of other shapes than the registry's (which covers the released one).

transformers 5.24 drops ``mtp.*``, so the reference is assembled from its pieces: a
``NemotronHModel`` whose ``layers_block_type`` is one MTP layer's blocks, loaded from that
layer's tensors (``final_layernorm`` as its ``norm_f``), run on the fused input
``eh_proj([enorm(embed(x_{s+1})), hnorm(h)])``, with h the transformers backbone's output.
"""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.workers.engine.helpers import GREEDY, make_llm
from tests.workers.models.harness import Harness, random_prompts
from tests.workers.models.hf_oracle import hf_model
from tests.workers.models.test_mtp_head import catch_up, with_config
from tests.workers.tp.threads import run_ranks
from tools.tiny import make_tiny_checkpoint
from workers.device_pools import build_pools
from workers.loader import load_model
from workers.state_spec import ATTENTION
from workers.tp import shard_model, shard_module

CHAINED = dict(num_nextn_predict_layers=2, mtp_layers_block_type=["moe", "full_attention", "mlp"], moe_latent_size=32)
SPEC = {"method": "mtp", "num_draft_tokens": 3}


@pytest.fixture(scope="module")
def chained_dir(tmp_path_factory) -> Path:
    """Two MTP layers of three blocks (MoE on latent projections, attention, MLP)."""
    return make_tiny_checkpoint("nemotron_h", tmp_path_factory.mktemp("nemo_mtp2"), seed=5, mtp=True, **CHAINED)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_layer(cfg, weights: dict[str, torch.Tensor], m: int) -> torch.nn.Module:
    """transformers' ``NemotronHModel`` over MTP layer ``m``'s blocks (see the module docstring)."""
    import transformers

    kinds = list(cfg.mtp_layers_block_type)
    ref_cfg = copy.deepcopy(cfg)
    ref_cfg.layers_block_type = kinds
    ref = transformers.NemotronHModel(ref_cfg).eval()
    state = {"embeddings.weight": torch.zeros_like(ref.embeddings.weight)}
    experts: dict[str, list[torch.Tensor]] = {}
    for b in range(len(kinds)):
        src = f"mtp.layers.{m * len(kinds) + b}."
        for name, t in weights.items():
            if not name.startswith(src):
                continue
            rest = name[len(src) :]
            if rest == "final_layernorm.weight":
                state["norm_f.weight"] = t
            elif rest.split(".")[0] in ("enorm", "hnorm", "eh_proj"):
                continue
            elif ".experts." in rest:  # experts.{e}.{up,down}_proj.weight -> stacked
                _, _, e, proj, _ = rest.split(".")
                experts.setdefault(f"layers.{b}.mixer.experts.{proj}", []).append((int(e), t))
            else:
                state[f"layers.{b}.{rest}"] = t
    for name, items in experts.items():
        state[name] = torch.stack([t for _, t in sorted(items, key=lambda it: it[0])])
    ref.load_state_dict(state, strict=True)
    return ref


@torch.inference_mode()
def reference_outputs(model_dir: Path, prompt: list[int], nxt: list[int]) -> list[torch.Tensor]:
    """Each MTP layer's rows 0..L-1 for one prompt (layer m > 0 reads layer m-1 at s - 1)."""
    hf = hf_model(model_dir)
    cfg = hf.config
    weights = load_model(model_dir, torch.float32, "cpu").model.mtp_weights
    hidden = hf.model(input_ids=torch.tensor([prompt])).last_hidden_state[0]
    emb = hf.model.embeddings(torch.tensor(nxt))
    outs = []
    for m in range(cfg.num_nextn_predict_layers):
        first = f"mtp.layers.{m * len(cfg.mtp_layers_block_type)}."
        eps = cfg.layer_norm_epsilon
        fused = torch.cat(
            [_rms(emb, weights[first + "enorm.weight"], eps), _rms(hidden, weights[first + "hnorm.weight"], eps)],
            dim=-1,
        )
        x = fused @ weights[first + "eh_proj.weight"].T
        out = reference_layer(cfg, weights, m)(inputs_embeds=x[None]).last_hidden_state[0]
        outs.append(out)
        hidden = torch.cat([torch.zeros_like(out[:1]), out[:-1]])
    return outs


@torch.inference_mode()
def head_outputs(model_dir: Path, prompts: list[list[int]], nxts: list[list[int]], comm=None):
    """Our head over every prompt in one batch, every MTP layer; -> per layer, per prompt.
    With ``comm``, the model and the head are this TP rank's shards."""
    model = load_model(model_dir, torch.float32, "cpu").model
    if comm is not None:
        shard_model(model, comm)
    spec = model.cache_spec()
    num_kv = spec.num_layers(ATTENTION)
    h = Harness(model, max_seqs=len(prompts), max_tokens=64)
    pools = build_pools(
        spec.with_layers(ATTENTION, num_kv + model.num_mtp_kv_layers),
        h.pools.kv.num_pages,
        h.page_size,
        h.pools.mamba.num_slots,
        torch.float32,
        torch.device("cpu"),
    )
    pools.mamba = h.pools.mamba
    h.pools = pools
    head = model.build_mtp_head(num_kv)
    if comm is not None:
        shard_module(head, comm)
    batch = h.make_batch(list(enumerate(prompts)))
    hidden = model(batch, h.pools)
    shifted = replace(batch, input_ids=torch.tensor([t for n in nxts for t in n]))
    cu = batch.cu_seqlens.tolist()
    outs = []
    for m in range(head.num_layers):
        out = head(shifted, hidden, h.pools, layer=m)
        outs.append([out[cu[b] : cu[b + 1]] for b in range(len(prompts))])
        hidden = torch.zeros_like(out)
        for b in range(len(prompts)):
            hidden[cu[b] + 1 : cu[b + 1]] = out[cu[b] : cu[b + 1] - 1]
    return outs


@pytest.mark.parametrize("which", ["released", "chained"])
def test_head_equals_transformers_blocks(tiny_checkpoint, chained_dir, which):
    model_dir = tiny_checkpoint("nemotron_h") if which == "released" else chained_dir
    prompts = random_prompts(512, [7, 19, 12], seed=6)
    nxts = [p[1:] + [11] for p in prompts]
    ours = head_outputs(model_dir, prompts, nxts)
    for b, (prompt, nxt) in enumerate(zip(prompts, nxts)):
        refs = reference_outputs(model_dir, prompt, nxt)
        assert len(refs) == len(ours)
        for m, ref in enumerate(refs):
            torch.testing.assert_close(ours[m][b], ref, atol=1e-4, rtol=1e-4)


def test_chained_head_tp2_equals_tp1(chained_dir):
    """Ranks as threads: each rank's sharded head (attention by heads, experts, MLP and shared
    expert by their intermediate dims, fusion and latent projections replicated) sums to it."""
    prompts = random_prompts(512, [9, 14], seed=7)
    nxts = [p[1:] + [12] for p in prompts]
    expected = head_outputs(chained_dir, prompts, nxts)
    for got in run_ranks(2, lambda comm: head_outputs(chained_dir, prompts, nxts, comm)):
        for got_layer, exp_layer in zip(got, expected):
            for g, e in zip(got_layer, exp_layer):
                torch.testing.assert_close(g, e, atol=1e-5, rtol=0)


def test_legacy_mtp_pattern_loads_the_same_head(chained_dir, tmp_path):
    """``mtp_hybrid_override_pattern`` (as released configs write it) instead of the list."""
    symbols = {"full_attention": "*", "moe": "E", "mlp": "-"}
    legacy = tmp_path / "legacy"
    shutil.copytree(chained_dir, legacy)
    raw = json.loads((legacy / "config.json").read_text())
    raw["mtp_hybrid_override_pattern"] = "".join(symbols[k] for k in raw.pop("mtp_layers_block_type"))
    assert raw["mtp_hybrid_override_pattern"] == "E*-"
    (legacy / "config.json").write_text(json.dumps(raw))
    prompts = random_prompts(512, [10], seed=3)
    nxts = [p[1:] + [4] for p in prompts]
    for a, b in zip(head_outputs(chained_dir, prompts, nxts), head_outputs(legacy, prompts, nxts)):
        assert torch.equal(a[0], b[0])


def test_layout_blocks_and_kv_layers(chained_dir):
    model = load_model(chained_dir, torch.float32, "cpu").model
    assert (model.num_mtp_layers, model.num_mtp_kv_layers) == (2, 2)
    head = model.build_mtp_head(kv_index=5)
    assert head.num_layers == 2 and head.kv_index == 5 and len(head.layers) == 6
    assert [None if b.ref is None else b.ref.index for b in head.layers] == [None, 5, None, None, 6, None]
    assert [hasattr(b, "eh_proj") for b in head.layers] == [True, False, False] * 2
    assert [hasattr(b, "final_layernorm") for b in head.layers] == [False, False, True] * 2


@pytest.mark.parametrize(
    "fields,match",
    [
        (
            {"mtp_layers_block_type": ["full_attention", "linear_attention"]},
            r"mtp_layers_block_type=\['full_attention', 'linear_attention'\] has a Mamba2 block",
        ),
        (
            {"num_nextn_predict_layers": 2},
            r"num_nextn_predict_layers=2 .* blocks mtp.layers.0..3, "
            r"but .* hold blocks \[0, 1\]",
        ),
        ({"mtp_layers_block_type": ["full_attention"]}, r"blocks mtp.layers.0..0, but .* \[0, 1\]"),
        ({"num_nextn_predict_layers": 0}, r"num_nextn_predict_layers=0: .* at least one MTP layer"),
        ({"mtp_block_configs": [{"block_type": "moe"}]}, r"mtp_block_configs"),
        ({"mtp_use_dedicated_embeddings": True}, r"mtp_use_dedicated_embeddings=True"),
    ],
)
def test_head_refuses_what_it_cannot_build(tiny_checkpoint, tmp_path, fields, match):
    ckpt = with_config(tiny_checkpoint("nemotron_h"), tmp_path / "c", **fields)
    model = load_model(ckpt, torch.float32, "cpu").model
    with pytest.raises(ValueError, match=match):
        model.build_mtp_head(kv_index=2)
    if "linear_attention" in fields.get("mtp_layers_block_type", []):
        with pytest.raises(ValueError, match="Mamba2 block"):  # the engine says the same
            make_llm(ckpt, spec=SPEC)
        out = make_llm(ckpt).generate_ids([[5, 6, 7]], [GREEDY])  # without spec it serves
        assert len(out[0].token_ids) == GREEDY.max_tokens


def test_malformed_layer_count_is_refused_at_load(tiny_checkpoint, tmp_path):
    ckpt = with_config(tiny_checkpoint("nemotron_h"), tmp_path / "c", num_nextn_predict_layers=-1)
    with pytest.raises(ValueError, match=r"num_nextn_predict_layers=-1"):
        load_model(ckpt, torch.float32, "cpu")


def test_checkpoint_without_mtp_tensors(tmp_path):
    ckpt = make_tiny_checkpoint("nemotron_h", tmp_path, seed=1)  # the config names one layer
    model = load_model(ckpt, torch.float32, "cpu").model
    assert model.num_mtp_layers == model.num_mtp_kv_layers == 0
    with pytest.raises(ValueError, match=r"mtp\.\* tensors"):
        model.build_mtp_head(kv_index=2)


def _spec_equals_plain(model_dir: Path, **spec_overrides) -> object:
    prompts = random_prompts(512, [3, 9, 21, 14, 30], seed=8)
    prompts.append(prompts[2][:16] + [9, 10])
    params = [replace(GREEDY, max_tokens=12)] * len(prompts)
    control = make_llm(model_dir, cache={"enable_prefix_cache": False}, scheduler={"overlap": False})
    expected = [o.token_ids for o in control.generate_ids(prompts, params)]
    llm = make_llm(model_dir, spec=SPEC, debug={"check_invariants": True}, **spec_overrides)
    llm.engine.raise_on_violation = True
    for _ in range(2):  # the second pass hits the prefix cache
        assert [o.token_ids for o in llm.generate_ids(prompts, params)] == expected
    assert llm.stats()["hybridserve_spec_draft_tokens_total"] > 0
    return llm.engine


def test_chained_head_speculation_equals_plain(chained_dir):
    engine = _spec_equals_plain(chained_dir, scheduler={"overlap": True, "chunked_prefill_size": 8})
    assert engine.drafter.mtp.num_layers == 2
    target_kv = engine.model.cache_spec().num_layers(ATTENTION)
    assert engine.pools.kv.num_layers(ATTENTION) == target_kv + 2


def test_head_without_attention_keeps_no_kv(tmp_path):
    """An MTP layer of one MLP block: stateless, no extra KV layer, output unchanged."""
    ckpt = make_tiny_checkpoint("nemotron_h", tmp_path, seed=2, mtp=True, mtp_layers_block_type=["mlp"])
    engine = _spec_equals_plain(ckpt)
    assert engine.pools.kv.num_layers(ATTENTION) == engine.model.cache_spec().num_layers(ATTENTION)


def test_chained_catch_up_in_chunks_equals_one_pass(chained_dir):
    """Layer 1's first row of a chunk reads layer 0's last row of the previous chunk."""
    model = load_model(chained_dir, torch.float32, "cpu").model
    prompt = random_prompts(model.config.vocab_size, [21], seed=4)[0]
    drafts, kv = catch_up(model, prompt, [21], next_token=9)
    chunked_drafts, chunked_kv = catch_up(model, prompt, [8, 6, 7], next_token=9)
    assert bool((kv.abs() < 1e3).all())
    torch.testing.assert_close(chunked_kv, kv, atol=1e-5, rtol=0)
    assert chunked_drafts == drafts
