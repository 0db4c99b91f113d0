"""How many Mamba slots a running request holds for its checkpoints (slot pressure).

After a mid-request publication an ``extra_buffer_lazy`` request holds no idle keep slot: it takes one at its
next write. With one held idle, 3 running requests (live + keep + their own published,
locked checkpoint each) fill 8 slots and a third request never checkpoints its prompt
(on ``slot_pressure``, keep allocations fail). A decode checkpoint
never evicts another for its slot.
"""

from __future__ import annotations

from tests.workers.engine.helpers import make_llm, random_prompts
from workers.sampling.params import SamplingParams

P = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def llm_for(model_dir, strategy, **cache):
    llm = make_llm(
        model_dir,
        cache={"mamba_strategy": strategy, "page_size": 4, "mamba_track_interval": 256, **cache},
        debug={"check_invariants": True},
    )
    llm.engine.raise_on_violation = True
    return llm


def run_watching(llm, prompt):
    """Step one request to its finish; the roles of the slots it held after each step."""
    engine = llm.engine
    llm.add_request("r", prompt, P)
    req = engine.requests["r"]
    roles, outs = [], []
    while engine.has_unfinished():
        outs += llm.step()
        if req.mamba_slot is not None:
            roles.append(
                (
                    req.num_computed_tokens,
                    sorted(r.value for r in engine.cache.ledger.slots_of(req.handle).values()),
                    req.cache.keep_depth,
                )
            )
    return roles, outs


def test_no_idle_keep_slot_after_a_publication(tiny_qwen_dir):
    """extra_buffer_lazy (extra_buffer owns its two track slots by design)."""
    llm = llm_for(tiny_qwen_dir, "extra_buffer_lazy")
    prompt = random_prompts(llm.engine.vocab_size, [23], seed=4)[0]
    roles, _ = run_watching(llm, prompt)
    tree = llm.engine.cache.tree
    # Published: the prompt's checkpoint (20) and the end of the output (32).
    assert tree.peek(prompt[:22]).depth == 20
    # Between the two, while decoding, the request held no keep slot with nothing in it.
    between = [r for d, r, keep in roles if 24 <= d < 31 and keep is None]  # after the overlap lag
    assert between and all("keep" not in r for r in between), roles


def test_a_decode_checkpoint_does_not_evict_for_its_slot(tiny_qwen_dir):
    """Every slot but the live one is taken by others' checkpoints: the prompt's own
    checkpoint may evict one (its keep slot at admission), the end-of-output one may not."""
    llm = llm_for(tiny_qwen_dir, "extra_buffer_lazy", max_mamba_slots=4)
    vocab = llm.engine.vocab_size
    for seed in (7, 8):
        llm.generate_ids([random_prompts(vocab, [13], seed=seed)[0]], [P])
    before = llm.stats()["hybridserve_mamba_checkpoints_evicted_total"]
    prompt = random_prompts(vocab, [23], seed=9)[0]
    outs = llm.generate_ids([prompt], [P])
    tree = llm.engine.cache.tree
    assert tree.peek(prompt[:22]).depth == 20
    assert tree.peek((prompt + outs[0].token_ids)[:32]).depth == 20  # no end-of-output checkpoint
    assert llm.stats()["hybridserve_mamba_checkpoints_evicted_total"] - before == 1
