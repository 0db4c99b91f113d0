"""Sharding math without processes: ranks are threads, the all-reduce sums in memory.

Every sharded layer kind -- attention, Gated DeltaNet, Mamba2 (groups sharded and groups
replicated with a cross-rank norm), MoE, dense MLP -- runs on the tiny checkpoints' real
weights over a prefill step and a decode step that continues from the states and KV the
prefill wrote into each rank's pool shard; the summed result must equal the unsharded
layer. Whole models likewise, to the logits.
"""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch

from tests.workers.models.harness import Harness, random_prompts
from tests.workers.tp.threads import run_ranks
from tools.tiny import redraw_
from workers.device_pools import DevicePools, build_pools
from workers.forward_batch import ForwardBatch
from workers.loader import load_config, load_model
from workers.models.layers import Attention, LayerContext
from workers.models.mamba2 import Mamba2Dims, Mamba2Mixer
from workers.state_spec import CacheSpec, StateGroup, StateRef
from workers.tp import shard_model, shard_module, validate_tp

ATOL = 1e-5


@pytest.fixture(scope="module")
def qwen(tiny_qwen_dir):
    return load_model(tiny_qwen_dir, torch.float32, "cpu").model


@pytest.fixture(scope="module")
def granite(tiny_granite_dir):
    return load_model(tiny_granite_dir, torch.float32, "cpu").model


def two_steps(model, spec: CacheSpec | None = None) -> tuple[Harness, list[ForwardBatch]]:
    """A prefill of two prompts (7 and 12 tokens), then one decode token each."""
    h = Harness(model, max_seqs=4, max_tokens=32)
    if spec is not None:  # a standalone layer: pools of its own shape
        h.pools = shard_pools(spec, h.pools)
    p = random_prompts(64, [7, 12], seed=3)
    return h, [h.make_batch([(0, p[0]), (1, p[1])]), h.make_batch([(0, [5]), (1, [9])])]


def shard_pools(spec: CacheSpec, like: DevicePools) -> DevicePools:
    pools = build_pools(
        spec, like.kv.num_pages, like.kv.page_size, like.mamba.num_slots, torch.float32, torch.device("cpu")
    )
    for t in pools.kv.tensors():
        t.fill_(1e4)  # never-written state shows up as garbage
    for t in pools.mamba.tensors():
        t.fill_(float("nan"))
    return pools


def local_spec(layer, full: CacheSpec) -> CacheSpec:
    """``full`` with the group of ``layer``'s own state kind shaped as the (sharded) layer says."""
    if not hasattr(layer, "state_kind"):
        return full
    kind = layer.state_kind()
    return CacheSpec(tuple(StateGroup(kind, g.num_layers) if g.kind.name == kind.name else g for g in full.groups))


def run_layer(layer, batches, xs, pools, rotary, ref: StateRef | None) -> list[torch.Tensor]:
    outs = []
    for batch, x in zip(batches, xs):
        if isinstance(layer, Attention):
            rope = rotary.tables(batch.positions, x.dtype) if rotary is not None else None
            outs.append(layer(x, LayerContext(batch, pools, rope), ref))
        elif hasattr(layer, "state_kind"):  # a recurrent mixer
            outs.append(layer(x, LayerContext(batch, pools), ref))
        else:
            outs.append(layer(x))
    return outs


def check_layer(layer, model, spec: CacheSpec, ref: StateRef | None = None, world: int = 2) -> None:
    h, batches = two_steps(model, spec)
    gen = torch.Generator().manual_seed(7)
    hidden = spec_hidden(layer)
    xs = [torch.randn(b.num_tokens, hidden, generator=gen) for b in batches]
    rotary = getattr(model, "rotary", None)
    with torch.inference_mode():
        expected = run_layer(layer, batches, xs, h.pools, rotary, ref)

    def rank(comm):
        mine = copy.deepcopy(layer)
        shard_module(mine, comm)
        pools = shard_pools(local_spec(mine, spec), h.pools)
        return run_layer(mine, batches, xs, pools, rotary, ref)

    for got in run_ranks(world, rank):
        for g, e in zip(got, expected):
            assert torch.isfinite(e).all()
            torch.testing.assert_close(g, e, atol=ATOL, rtol=0)


def spec_hidden(layer) -> int:
    for name in ("o_proj", "out_proj", "down_proj"):
        if hasattr(layer, name):
            return getattr(layer, name).out_features
    return layer.dims.hidden_size


def mixer_of(model, layer_idx: int):
    layer = model.model.layers[layer_idx]
    return getattr(layer, layer.mixer_name), layer.ref


@pytest.mark.parametrize("kind", ["attention", "gdn", "moe", "mlp"])
def test_qwen_layers(qwen, kind):
    kinds = list(qwen.config.layer_types)
    if kind in ("attention", "gdn"):
        idx = kinds.index("full_attention" if kind == "attention" else "linear_attention")
        mixer, ref = mixer_of(qwen, idx)
        check_layer(mixer, qwen, qwen.cache_spec(), ref)
    else:
        ffn = qwen.model.layers[1 if kind == "moe" else 0].mlp  # layer 0 is mlp_only
        assert type(ffn).__name__ == ("SparseMoE" if kind == "moe" else "DenseMLP")
        check_layer(ffn, qwen, qwen.cache_spec())


@pytest.mark.parametrize("kind", ["gdn", "moe"])
def test_qwen3_5_layers(tiny_checkpoint, kind):
    """Qwen3.5's unfused GDN projections (``in_proj_qkv`` / ``z`` / ``b`` / ``a``) and its MoE."""
    model = load_model(tiny_checkpoint("qwen3_5_moe_vl"), torch.float32, "cpu").model
    if kind == "gdn":
        mixer, ref = mixer_of(model, list(model.config.layer_types).index("linear_attention"))
        assert type(mixer).__name__ == "SplitGatedDeltaNet"
        check_layer(mixer, model, model.cache_spec(), ref)
    else:
        check_layer(model.model.layers[0].mlp, model, model.cache_spec())


@pytest.mark.parametrize("kind", ["attention", "mamba2", "moe", "shared_mlp"])
def test_granite_layers(granite, kind):
    if kind in ("attention", "mamba2"):
        mixer, ref = mixer_of(granite, 1 if kind == "attention" else 0)
        check_layer(mixer, granite, granite.cache_spec(), ref)
    else:
        layer = granite.model.layers[0]
        check_layer(
            getattr(layer, "block_sparse_moe" if kind == "moe" else "shared_mlp"), granite, granite.cache_spec()
        )


@pytest.mark.parametrize("num_groups,world", [(1, 2), (2, 4), (4, 2)])
def test_mamba2_groups_sharded_or_replicated(granite, num_groups, world):
    """Granite-4.0-H has one B/C group: each rank keeps it and the gated norm spans ranks."""
    dims = Mamba2Dims(
        hidden_size=32,
        num_heads=8,
        head_dim=8,
        state_size=8,
        num_groups=num_groups,
        conv_kernel=4,
        conv_bias=True,
        proj_bias=True,
        chunk_size=4,
        dt_limit=(0.0, float("inf")),
        eps=1e-5,
    )
    mixer = Mamba2Mixer(dims, torch.float32)
    gen = torch.Generator().manual_seed(num_groups)
    with torch.no_grad():
        for name, p in mixer.named_parameters():
            redraw_(f"mixer.{name}", p, gen, zero_centered_norms=False)
    spec = CacheSpec((StateGroup(mixer.state_kind(), 1),))
    check_layer(mixer, granite, spec, StateRef("mamba2", 0), world=world)


@pytest.mark.parametrize(
    "family,layer_idx",
    [("jamba", 0), ("lfm2", 0), ("lfm3", 1)],
    ids=["mamba1", "short_conv", "gated_sliding_attention"],
)
def test_new_state_kind_layers(tiny_checkpoint, family, layer_idx):
    """Mamba1 (x_proj's partial sum all-reduced), the short conv, Lfm3's head-gated sliding
    attention: each sharded layer, over its own pool shard, equals the whole layer."""
    model = load_model(tiny_checkpoint(family), torch.float32, "cpu").model
    layer = model.model.layers[layer_idx]
    mixer, ref = getattr(layer, layer.mixer_name), layer.ref
    with mock.patch.object(model, "rotary", getattr(layer, "rotary", None) or model.rotary):
        check_layer(mixer, model, model.cache_spec(), ref)


@pytest.fixture(scope="module")
def family_model(tiny_model):
    return load_model(tiny_model.path, torch.float32, "cpu").model


def test_whole_model_logits(family_model, tiny_model):
    """Every registered family at its ``tp_world``: prefill + 3 decodes, to the logits."""
    model = family_model
    prompts = random_prompts(model.config.vocab_size, [9, 4, 21], seed=5)

    def generate(m) -> list[torch.Tensor]:
        h = Harness(m, max_seqs=4, max_tokens=64)
        first = h.prefill(prompts)
        out, last = [torch.cat(first)], [int(x[-1].argmax()) for x in first]
        for _ in range(3):
            step = h.decode(last)
            out.append(torch.stack(step))
            last = [int(x.argmax()) for x in step]
        return out

    with torch.inference_mode():
        expected = generate(model)

    def rank(comm):
        mine = copy.deepcopy(model)
        shard_model(mine, comm)
        return generate(mine)

    for got in run_ranks(tiny_model.family.tp_world, rank):
        for g, e in zip(got, expected):
            # sharded sums run in another order: bailing_hybrid's prefill logits (|x| <= ~5)
            # differ by up to 9e-5 with MKL's experts, 1.2e-4 with the fused few-rows ones
            torch.testing.assert_close(g, e, atol=2e-4, rtol=0)


def test_pool_shard_shapes(family_model):
    """A sharded model's ``cache_spec()`` is its rank's shard: heads (conv channels) / 2, an
    MLA latent row and a tensor marked ``replicated`` (a conv over the hidden size) whole."""

    def specs(model):
        return run_ranks(2, lambda comm: (shard_model(m := copy.deepcopy(model), comm), m.cache_spec())[1])

    def shapes(spec: CacheSpec) -> dict[tuple[str, str], tuple[int, ...]]:
        return {(g.kind.name, t.name): t.shape for g in spec.groups for t in g.kind.tensors}

    replicated = {
        (g.kind.name, t.name) for g in family_model.cache_spec().groups for t in g.kind.tensors if t.replicated
    }

    def halved(key: tuple[str, str], shape: tuple[int, ...]) -> tuple[int, ...]:  # heads (or conv channels) / 2
        if shape[0] == 1 or key in replicated:  # one row shared by every head (MLA's latent), or whole
            return shape
        return (shape[0] // 2, *shape[1:])

    full = shapes(family_model.cache_spec())
    for s in specs(family_model):
        assert shapes(s) == {key: halved(key, shape) for key, shape in full.items()}
        assert [g.num_layers for g in s.groups] == [g.num_layers for g in family_model.cache_spec().groups]


def test_sizes_that_do_not_divide_are_refused(tiny_qwen_dir, tiny_granite_dir):
    validate_tp(load_config(tiny_qwen_dir), 2)
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size=3 .*num_attention_heads=4.*"
        r"num_key_value_heads=2",
    ):
        validate_tp(load_config(tiny_qwen_dir), 3)
    with pytest.raises(ValueError, match="linear_num_key_heads=2"):
        validate_tp(load_config(tiny_qwen_dir), 4)
    with pytest.raises(ValueError, match=r"mamba_n_groups=2 \(neither divides"):
        validate_tp(load_config(tiny_granite_dir), 3)
