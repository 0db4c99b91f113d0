"""Each logits processor against transformers' processor of the same name, on the same
logits and histories, through the real host builder and device ops (decode and verify
rows, whose history includes the drafts before them)."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tests.workers.sampling.helpers import EOS, Harness, decode, request, verify
from workers.sampling.params import SamplingParams
from workers.sampling.processors import filter_rows

V = 64


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def histories(reqs, drafts):
    """Per logits row: (prompt, outputs as of that row) -- decode rows, then verify rows."""
    out = []
    for req, ds in zip(reqs, drafts):
        for i in range(len(ds) + 1):
            out.append((req.prompt_token_ids, req.output_token_ids + ds[:i]))
    return out


def hf_rows(processor_of, raw, hist):
    rows = []
    for r, (prompt, outputs) in enumerate(hist):
        ids = torch.tensor([prompt + outputs])
        rows.append(processor_of(prompt, outputs)(ids, raw[r : r + 1].clone()))
    return torch.cat(rows)


def batch(params_list, prompts, outputs, drafts, bad_words=()):
    reqs = [
        request(f"r{i}", p, o, params, bad_words) for i, (params, p, o) in enumerate(zip(params_list, prompts, outputs))
    ]
    seqs = [verify(r, len(d)) if d else decode(r) for r, d in zip(reqs, drafts)]
    return reqs, seqs


PROMPTS = [[5, 6, 7, 5], [9, 9, 3], [11, 12, 13, 14, 15]]
OUTPUTS = [[7, 20, 20, 21], [3, 30], [40, 41, 40, 40, 2]]
DRAFTS = [[], [30, 31, 30], [40, 20]]


def run(params_list, bad_words=(), seed=0):
    reqs, seqs = batch(params_list, PROMPTS, OUTPUTS, DRAFTS, bad_words)
    raw = logits(sum(len(d) + 1 for d in DRAFTS), seed)
    got = Harness(V).process(seqs, raw, DRAFTS)
    return raw, got, histories(reqs, DRAFTS)


def test_repetition_penalty_matches_transformers():
    raw, got, hist = run([SamplingParams(repetition_penalty=1.7)] * 3)
    want = hf_rows(lambda p, o: RepetitionPenaltyLogitsProcessor(1.7), raw, hist)
    torch.testing.assert_close(got, want)
    assert not torch.equal(got, raw)


def test_repetition_penalty_below_one_rewards_repeats():
    raw, got, hist = run([SamplingParams(repetition_penalty=0.5)] * 3, seed=1)
    torch.testing.assert_close(got, hf_rows(lambda p, o: RepetitionPenaltyLogitsProcessor(0.5), raw, hist))


def test_frequency_and_presence_follow_openai():
    raw, got, hist = run([SamplingParams(frequency_penalty=0.7, presence_penalty=-1.1)] * 3)
    want = raw.clone()
    for r, (_, outputs) in enumerate(hist):  # output tokens only, not the prompt
        counts = torch.bincount(torch.tensor(outputs, dtype=torch.int64), minlength=V).float()
        want[r] -= 0.7 * counts + -1.1 * (counts > 0).float()
    torch.testing.assert_close(got, want)


def test_logit_bias_matches_sequence_bias():
    bias = {3: 5.0, 17: -100.0, 40: 100.0}
    raw, got, hist = run([SamplingParams(logit_bias=bias)] * 3)
    proc = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])
    torch.testing.assert_close(got, hf_rows(lambda p, o: proc, raw, hist))
    assert (got.argmax(-1) == 40).all()  # +100 forces the token


def test_min_tokens_blocks_eos_and_stop_tokens_until_reached():
    # Row output counts run 4 (decode), 2..5 (verify), 5..7 (verify): min_tokens=5 blocks some.
    params = SamplingParams(min_tokens=5, max_tokens=20, stop_token_ids=[8])
    raw, got, hist = run([params] * 3)
    want = hf_rows(lambda p, o: MinNewTokensLengthLogitsProcessor(len(p), 5, [EOS, 8]), raw, hist)
    torch.testing.assert_close(got, want)
    blocked = [len(o) < 5 for _, o in hist]
    assert torch.isinf(got[:, EOS]).tolist() == blocked and any(blocked) and not all(blocked)


def test_min_tokens_with_ignore_eos_blocks_only_stop_tokens():
    params = SamplingParams(min_tokens=9, max_tokens=20, stop_token_ids=[8], ignore_eos=True)
    raw, got, _ = run([params] * 3)
    assert torch.isinf(got[:, 8]).all() and torch.isfinite(got[:, EOS]).all()


def test_bad_words_match_no_bad_words_processor_over_outputs():
    # (20,) always banned; (40, 2) after 40; (30, 31, 5) after 30 31 -- reached inside a verify.
    words = ((20,), (40, 2), (30, 31, 5), (7, 20, 9))
    raw, got, hist = run([SamplingParams()] * 3, bad_words=words)
    # vLLM's rule: a word's prefix is matched against the generated tokens only.
    want = hf_rows(lambda p, o: NoBadWordsLogitsProcessor([list(w) for w in words]), raw, [([], o) for _, o in hist])
    torch.testing.assert_close(got, want)
    assert torch.isinf(got[:, 20]).all()
    assert torch.isinf(got[3, 5])  # the second verify, after drafts 30 31


def test_all_processors_together_in_transformers_order():
    p = SamplingParams(repetition_penalty=1.3, logit_bias={3: 2.0, 30: -1.5}, min_tokens=5, max_tokens=9)
    words = ((41, 40),)
    raw, got, hist = run([p] * 3, bad_words=words)

    def chain(prompt, outputs):
        procs = [
            SequenceBiasLogitsProcessor([[[3], 2.0], [[30], -1.5]]),
            MinNewTokensLengthLogitsProcessor(len(prompt), 5, [EOS]),
        ]

        def apply(ids, scores):
            scores = procs[0](ids, scores)
            out_ids = torch.tensor([list(outputs)]) if outputs else ids[:, :0]
            scores = NoBadWordsLogitsProcessor([list(w) for w in words])(out_ids, scores)
            scores = procs[1](ids, scores)
            return RepetitionPenaltyLogitsProcessor(1.3)(ids, scores)

        return apply

    torch.testing.assert_close(got, hf_rows(chain, raw, hist))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.7},
        {"temperature": 1.3, "top_k": 5},
        {"temperature": 0.9, "top_p": 0.6},
        {"temperature": 1.0, "min_p": 0.2},
        {"temperature": 1.5, "top_k": 12, "top_p": 0.8, "min_p": 0.05},
    ],
)
def test_filters_match_transformers_warpers(kwargs):
    p = SamplingParams(**kwargs)
    reqs, seqs = batch([p, SamplingParams(temperature=0.0), p], PROMPTS, OUTPUTS, DRAFTS)
    raw = logits(8, seed=3)
    si = Harness(V).build(seqs)
    got = filter_rows(raw.clone(), si.filters)
    warpers = [TemperatureLogitsWarper(p.temperature)]
    if p.effective_top_k:
        warpers.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1:
        warpers.append(TopPLogitsWarper(p.top_p))
    if p.min_p > 0:
        warpers.append(MinPLogitsWarper(p.min_p))
    ids = torch.zeros(1, 1, dtype=torch.int64)
    for r in range(8):
        if 1 <= r <= 4:  # the greedy request's rows: untouched
            torch.testing.assert_close(got[r], raw[r])
            continue
        want = raw[r : r + 1].clone()
        for w in warpers:
            want = w(ids, want)
        torch.testing.assert_close(got[r : r + 1], want)
