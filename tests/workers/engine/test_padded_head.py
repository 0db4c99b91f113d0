"""A head padded past ``unpadded_vocab_size`` (Inkling): the engine's vocabulary is the
logits' width, so a token id in the spare rows is refused by name (as a prompt id, a logit
bias, a stop token) instead of failing a step, and prompt logprobs cover every prompt id."""

from __future__ import annotations

import pytest

from tests.workers.engine.helpers import assert_no_leaks, make_llm
from tools.tiny import make_tiny_checkpoint
from workers.sampling.params import SamplingParams

UNPADDED = 500


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    ckpt = make_tiny_checkpoint("inkling", tmp_path_factory.mktemp("padded"), seed=5, unpadded_vocab_size=UNPADDED)
    return make_llm(ckpt)


def test_the_vocabulary_is_the_logits_width(llm) -> None:
    assert llm.engine.hf_config.vocab_size > UNPADDED == llm.engine.vocab_size


@pytest.mark.parametrize(
    "prompt, params",
    [
        ([5, UNPADDED + 3, 7], SamplingParams(max_tokens=2)),
        ([5, 6, 7], SamplingParams(max_tokens=2, logit_bias={UNPADDED + 1: 5.0})),
        ([5, 6, 7], SamplingParams(max_tokens=2, stop_token_ids=[UNPADDED])),
    ],
)
def test_ids_in_the_padding_are_refused_and_the_engine_goes_on(llm, prompt, params) -> None:
    with pytest.raises(ValueError, match=rf"\[0, {UNPADDED}\)"):
        llm.generate_ids([prompt], [params])
    out = llm.generate_ids([[5, UNPADDED - 1, 7]], [SamplingParams(max_tokens=3, prompt_logprobs=2)])[0]
    assert len(out.token_ids) == 3 and len(out.prompt_logprobs) == 3
    assert_no_leaks(llm)
