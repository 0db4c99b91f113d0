"""A greedy verify reads the host once: its picked tokens and the drafts they are checked
against come back in one ``.tolist()`` (a GPU syncs once per verify step, not twice), and
the outputs stay those of speculation off."""

from __future__ import annotations

from tests.gpu.host_reads import host_reads
from tests.workers.engine.helpers import make_llm, random_prompts
from workers.sampling.decide import BatchSampler
from workers.sampling.params import SamplingParams

P = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_greedy_verify_reads_the_host_once(monkeypatch, tiny_qwen_dir):
    reads: list[list[str]] = []
    decide = BatchSampler.decide

    def recorded(self, si, input_ids, logits, params, gens, verify, draft_q):
        out = []
        found = host_reads(lambda: out.append(decide(self, si, input_ids, logits, params, gens, verify, draft_q)))
        if any(v is not None for v in verify):
            reads.append([r for r in found if r.startswith(("tolist", "item"))])
        return out[0]

    monkeypatch.setattr(BatchSampler, "decide", recorded)
    spec = make_llm(tiny_qwen_dir, spec={"method": "mtp", "num_draft_tokens": 2})
    prompts = random_prompts(spec.engine.vocab_size, [7, 12], seed=5)
    got = [o.token_ids for o in spec.generate_ids(prompts, [P] * 2)]
    assert reads, "no verify step ran"
    assert all(len(r) == 1 for r in reads), reads
    monkeypatch.setattr(BatchSampler, "decide", decide)
    plain = make_llm(tiny_qwen_dir)
    assert got == [o.token_ids for o in plain.generate_ids(prompts, [P] * 2)]
