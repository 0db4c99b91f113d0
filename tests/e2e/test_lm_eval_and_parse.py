"""Third-party clients against a live server (Ray Serve, loopback): lm-eval 0.4.13's
``local-completions`` runs a multiple-choice loglikelihood task on a local dataset, and
the official ``openai`` client's ``chat.completions.parse`` gets a valid pydantic object."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
import torch
from pydantic import BaseModel, Field

from tests.workers.models.hf_oracle import HFOracle

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]
MODEL = "tiny-eval"

DOCS = [
    {"question": "The sky is", "choices": ["blue", "green", "a loud noise"], "answer": 0},
    {"question": "def add(a, b): return", "choices": ["a + b", "a * b"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["four", "five", "twenty two", "none"], "answer": 0},
]
TASK = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def app(deployed, tiny_qwen_dir):
    return deployed("evalapp", str(tiny_qwen_dir), args={"model_name": MODEL})


def test_lm_eval_loglikelihoods_equal_transformers(app, tiny_qwen_dir, tmp_path, monkeypatch):
    import lm_eval
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    data = tmp_path / "tiny_mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "tiny_mc.yaml").write_text(TASK.format(data=data))
    lm = LocalCompletionsAPI(
        base_url=f"{app.openai_base}/completions",
        model=MODEL,
        tokenizer=str(tiny_qwen_dir),
        tokenizer_backend="huggingface",
        tokenized_requests=True,
        num_concurrent=1,
        max_retries=1,
        max_length=1024,
    )
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=["tiny_mc"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True,
        num_fewshot=0,
    )
    samples = results["samples"]["tiny_mc"]
    assert len(samples) == len(DOCS) and "acc,none" in results["results"]["tiny_mc"]
    oracle = HFOracle(tiny_qwen_dir)
    checked = 0
    for sample in samples:
        doc = sample["doc"]
        for choice, resp in zip(doc["choices"], sample["resps"]):
            ctx, cont = lm._encode_pair(doc["question"], " " + choice)
            ids = ctx + cont
            lps = torch.log_softmax(oracle.logits(ids), dim=-1)
            want = sum(float(lps[j - 1, ids[j]]) for j in range(len(ctx), len(ids)))
            got = resp[0][0]
            assert abs(got - want) <= 1e-4, (doc["question"], choice, got, want)
            checked += 1
    assert checked == sum(len(d["choices"]) for d in DOCS)


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)
    indoor: bool


def test_openai_parse_returns_a_valid_object(app):
    client = openai.OpenAI(base_url=app.openai_base, api_key="none", max_retries=0, timeout=120)
    for seed in range(3):
        completion = client.chat.completions.parse(
            model=MODEL,
            messages=[{"role": "user", "content": "Describe a pet."}],
            response_format=Pet,
            max_tokens=200,
            temperature=0.7,
            seed=seed,
        )
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "stop"
        assert isinstance(message.parsed, Pet)
        assert Pet.model_validate_json(message.content) == message.parsed
