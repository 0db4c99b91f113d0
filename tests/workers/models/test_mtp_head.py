"""The MTP head from the model (``build_mtp_head``): layer count, refusals, multi-layer catch-up."""

from __future__ import annotations

import json

import pytest
import torch

from tests.workers.models.harness import Harness, random_prompts
from tools.tiny import make_tiny_checkpoint
from workers.device_pools import build_pools
from workers.loader import load_model
from workers.sampling.params import SamplingParams
from workers.spec.drafter import MtpDrafter, MtpSpan
from workers.state_spec import ATTENTION

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


@pytest.fixture(scope="module")
def two_layer_dir(tmp_path_factory):
    return make_tiny_checkpoint("qwen3_5", tmp_path_factory.mktemp("mtp2"), seed=2, mtp=True, mtp_num_hidden_layers=2)


def with_config(src, dst, **fields):
    """A copy of checkpoint ``src`` whose (text) config has ``fields`` set."""
    import shutil

    shutil.copytree(src, dst)
    path = dst / "config.json"
    raw = json.loads(path.read_text())
    (raw.get("text_config") or raw).update(fields)
    path.write_text(json.dumps(raw))
    return dst


def test_layer_count_comes_from_the_config(tiny_mtp_model_dir, two_layer_dir):
    model = load_model(tiny_mtp_model_dir, torch.float32, "cpu").model
    head = model.build_mtp_head(kv_index=7)
    assert model.num_mtp_layers == head.num_layers == 1 and head.kv_index == 7
    model = load_model(two_layer_dir, torch.float32, "cpu").model
    head = model.build_mtp_head(kv_index=2)
    assert head.num_layers == 2 and [layer.ref.index for layer in head.layers] == [2, 3]


@pytest.mark.parametrize(
    "fields,match",
    [
        ({"mtp_num_hidden_layers": 1}, r"mtp_num_hidden_layers=1, but .* layers \[0, 1\]"),
        ({"mtp_num_hidden_layers": 3}, r"mtp_num_hidden_layers=3, but .* layers \[0, 1\]"),
        ({"mtp_num_hidden_layers": 0}, r"mtp_num_hidden_layers=0: .* at least one layer"),
        ({"mtp_use_dedicated_embeddings": True}, r"mtp_use_dedicated_embeddings=True"),
    ],
)
def test_head_refuses_what_it_cannot_build(two_layer_dir, tmp_path, fields, match):
    ckpt = with_config(two_layer_dir, tmp_path / "c", **fields)
    model = load_model(ckpt, torch.float32, "cpu").model
    with pytest.raises(ValueError, match=match):
        model.build_mtp_head(kv_index=2)


def test_malformed_layer_count_is_refused_at_load(two_layer_dir, tmp_path):
    ckpt = with_config(two_layer_dir, tmp_path / "c", mtp_num_hidden_layers=-1)
    with pytest.raises(ValueError, match=r"mtp_num_hidden_layers=-1"):
        load_model(ckpt, torch.float32, "cpu")


def test_models_without_a_head(tiny_granite_dir, tiny_qwen_dir, tmp_path):
    granite = load_model(tiny_granite_dir, torch.float32, "cpu").model
    assert granite.num_mtp_layers == 0
    with pytest.raises(ValueError, match="MTP head"):
        granite.build_mtp_head(kv_index=2)
    bare = make_tiny_checkpoint("qwen3_5", tmp_path, seed=1)
    model = load_model(bare, torch.float32, "cpu").model
    assert model.num_mtp_layers == 0
    with pytest.raises(ValueError, match=r"mtp\.\* tensors"):
        model.build_mtp_head(kv_index=2)


def mtp_harness(model, num_drafts: int = 3) -> tuple[Harness, MtpDrafter]:
    """A harness whose KV pool has the head's layers too (garbage-filled), and a drafter of
    ``num_drafts`` on it (eager chain)."""
    spec = model.cache_spec()
    num_kv = spec.num_layers(ATTENTION)
    h = Harness(model, max_seqs=2, max_tokens=64)
    head_kv = model.num_mtp_kv_layers
    pools = build_pools(
        spec.with_layers(ATTENTION, num_kv + head_kv),
        h.pools.kv.num_pages,
        h.page_size,
        h.pools.mamba.num_slots,
        torch.float32,
        torch.device("cpu"),
    )
    pools.mamba = h.pools.mamba
    h.pools = pools
    h.pools.kv.k.fill_(1e4)
    drafter = MtpDrafter(
        model.build_mtp_head(num_kv),
        model,
        h.pools,
        num_drafts,
        h.page_size,
        256,
        h.pools.mamba.num_slots,
        torch.device("cpu"),
    )
    return h, drafter


def catch_up(model, prompt: list[int], chunks: list[int], next_token: int):
    """The target prefills ``prompt`` in ``chunks``; the drafter catches up after each one
    and drafts after the last. -> (drafts, the head's KV at positions 0..len-1
    [its KV layers, L, ...])."""
    num_kv = model.cache_spec().num_layers(ATTENTION)
    h, drafter = mtp_harness(model)
    start = 0
    with torch.inference_mode():
        for i, n in enumerate(chunks):
            hidden = model(h.make_batch([(0, prompt[start : start + n])]), h.pools)
            last = i == len(chunks) - 1
            nxt = prompt[start + 1 : start + n] + [next_token if last else prompt[start + n]]
            seq = h.seqs[0]
            drafter.run(
                [
                    MtpSpan(
                        start, hidden, torch.tensor(nxt), list(seq.pages), seq.slot, "r", GREEDY if last else None, None
                    )
                ]
            )
            start += n
    locs = [seq.pages[t // h.page_size] * h.page_size + t % h.page_size for t in range(len(prompt))]
    return drafter.draft_tokens[seq.slot].tolist(), h.pools.kv.k[num_kv:, locs]


def test_two_layer_catch_up_in_chunks_equals_one_pass(two_layer_dir):
    """Layer 1's row at a chunk's first position takes layer 0's output at the last
    position of the previous chunk (kept per slot), so chunking changes nothing."""
    model = load_model(two_layer_dir, torch.float32, "cpu").model
    prompt = random_prompts(model.config.vocab_size, [21], seed=4)[0]
    drafts, kv = catch_up(model, prompt, [21], next_token=9)
    chunked_drafts, chunked_kv = catch_up(model, prompt, [8, 6, 7], next_token=9)
    assert bool((kv.abs() < 1e3).all())  # every position of both layers written
    torch.testing.assert_close(chunked_kv, kv, atol=1e-5, rtol=0)
    assert chunked_drafts == drafts
