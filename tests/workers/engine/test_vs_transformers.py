"""The whole engine against transformers on tiny random checkpoints (fp32, CPU)."""

from __future__ import annotations

import torch

from tests.workers.engine.helpers import greedy_tokens, make_llm, random_prompts
from tests.workers.models.hf_oracle import hf_model

LENGTHS = [3, 8, 13, 21, 30, 34, 17, 5, 26]


def hf_greedy(model_dir, prompts: list[list[int]], n: int) -> list[list[int]]:
    model = hf_model(model_dir)
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            outs.append(gen[0, len(p) :].tolist())
    return outs


def test_greedy_32_tokens_match_transformers_batch_of_9(tiny_model_dir):
    llm = make_llm(tiny_model_dir, scheduler={"chunked_prefill_size": 16})
    prompts = random_prompts(llm.engine.vocab_size, LENGTHS, seed=3)
    ours = greedy_tokens(llm, prompts)
    theirs = hf_greedy(tiny_model_dir, prompts, 32)
    assert [len(t) for t in theirs] == [32] * len(prompts)
    assert ours == theirs
    # Outputs must be diverse enough for the comparison to mean something.
    assert all(len(set(t)) >= 6 for t in ours)
