"""Structured outputs: what the grammar allows is all the tiny random model can say, and
the tokens are the same with overlap, with MTP speculation (drafts the grammar rejects
included) and with the grammar still compiling when the request arrives."""

from __future__ import annotations

import json
import re
import threading
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from tests.workers.engine.helpers import OracleDrafts, make_llm, random_prompts
from workers.sampling.grammar import GrammarCompiler
from workers.sampling.params import SamplingParams
from workers.sampling.structured import StructuredOutput


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)
    indoor: bool
    # not max_length: xgrammar 0.2.9 lets it hold raw control characters
    name: str = Field(pattern=r"^[a-z]{1,6}$")


SCHEMA = StructuredOutput.json_schema(Pet.model_json_schema(), any_whitespace=False)
CONSTRAINTS = {
    "json_schema": SCHEMA,
    "regex": StructuredOutput.regex(r"[a-z]{2,5}-[0-9]{3}"),
    "choice": StructuredOutput.choice(["alpha", "beta", "gamma delta"]),
    "grammar": StructuredOutput.grammar('root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'),
    "structural_tag": StructuredOutput.structural_tag(
        {
            "type": "structural_tag",
            "format": {
                "type": "tag",
                "begin": "<n>",
                "end": "</n>",
                "content": {
                    "type": "json_schema",
                    "json_schema": {
                        "type": "object",
                        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
                        "required": ["n"],
                        "additionalProperties": False,
                    },
                },
            },
        }
    ),
}


def valid(kind: str, text: str) -> bool:
    if kind == "json_schema":
        Pet.model_validate_json(text)
        return True
    if kind == "regex":
        return re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", text) is not None
    if kind == "choice":
        return text in ("alpha", "beta", "gamma delta")
    if kind == "structural_tag":
        return text.startswith("<n>") and text.endswith("</n>") and 0 <= json.loads(text[3:-4])["n"] <= 99
    return re.fullmatch(r"\(([0-9x])(,[0-9x])*\)", text) is not None


def params(kind: str, **kw) -> SamplingParams:
    kw.setdefault("temperature", 0.0)
    return SamplingParams(max_tokens=60, structured_output=CONSTRAINTS[kind], **kw)


@pytest.fixture(scope="module")
def llm(tiny_qwen_dir):
    return make_llm(tiny_qwen_dir)


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_outputs_follow_the_grammar(llm, kind):
    prompts = random_prompts(512, [3, 8, 15, 6], seed=20)
    greedy = llm.generate_ids(prompts, [params(kind)] * 4)
    sampled = llm.generate_ids(prompts, [params(kind, temperature=1.0, seed=i) for i in range(4)])
    for out in greedy + sampled:
        assert out.finish_reason == "stop" and out.token_ids[-1] == 0  # the grammar ended, then EOS
        assert valid(kind, out.text), out.text
    if kind != "choice":
        assert len({o.text for o in sampled}) > 1


def test_json_object_and_whitespace(llm):
    params = SamplingParams(max_tokens=80, temperature=0.0, structured_output=StructuredOutput.json_object(False))
    out = llm.generate_ids([[5, 6]], [params])[0]
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:
        assert out.text.startswith("{")


def test_vllm_legacy_structural_tag_form():
    legacy = StructuredOutput.structural_tag(
        {
            "type": "structural_tag",
            "triggers": ["<f>"],
            "structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}],
        }
    )
    assert json.loads(legacy.spec)["format"]["type"] == "triggered_tags"
    with pytest.raises(ValueError, match="structural_tag"):
        StructuredOutput.structural_tag({"type": "structural_tag", "structures": [{"begin": "<f>"}]})


def test_bad_constraints_are_value_errors():
    for make in (
        lambda: StructuredOutput.json_schema({"type": "objectx"}),
        lambda: StructuredOutput.regex("(ab"),
        lambda: StructuredOutput.grammar("root ::= missing"),
        lambda: StructuredOutput.choice([]),
    ):
        with pytest.raises(ValueError, match="constraint|choice"):
            make()


def test_grammar_against_min_tokens_lets_the_grammar_win(llm):
    p = SamplingParams(max_tokens=10, temperature=0.0, min_tokens=6, structured_output=StructuredOutput.choice(["ok"]))
    out = llm.generate_ids([[5, 6, 7]], [p])[0]
    assert out.text == "ok" and out.finish_reason == "stop"


def test_ignore_eos_after_the_grammar_is_unconstrained(llm):
    p = SamplingParams(
        max_tokens=12,
        temperature=0.0,
        ignore_eos=True,
        skip_special_tokens=False,
        structured_output=StructuredOutput.choice(["ok"]),
    )
    out = llm.generate_ids([[5, 6, 7]], [p])[0]
    assert len(out.token_ids) == 12 and out.text.startswith("ok<|endoftext|>")


@pytest.fixture
def oracle(monkeypatch):
    """The corrupted drafts are often tokens the grammar forbids: the matcher must roll
    back the drafts it was advanced through."""
    return OracleDrafts(monkeypatch, lambda d: (d * 7 + 3) % 500, filler=7)


@pytest.mark.parametrize("overlap", [False, True])
def test_identical_under_speculation_and_overlap(tiny_qwen_dir, oracle, overlap):
    prompts = random_prompts(512, [3, 8, 15, 6, 11, 4, 9, 13, 5, 7], seed=21)
    plist = [params(k) for k in CONSTRAINTS] * 2
    plain = make_llm(tiny_qwen_dir, scheduler={"overlap": False})
    expected = [o.token_ids for o in plain.generate_ids(prompts, plist)]
    llm = make_llm(
        tiny_qwen_dir,
        scheduler={"overlap": overlap},
        spec={"method": "mtp", "num_draft_tokens": 3},
        debug={"check_invariants": True},
    )
    llm.engine.raise_on_violation = True
    oracle.expect(llm.engine, prompts, expected)
    assert [o.token_ids for o in llm.generate_ids(prompts, plist)] == expected
    stats = llm.stats()
    assert stats["hybridserve_spec_accepted_tokens_total"] > 20
    assert stats["hybridserve_spec_accepted_tokens_total"] < stats["hybridserve_spec_draft_tokens_total"]
    llm.generate_ids([[5]], [SamplingParams(max_tokens=1)])  # drops travel with the next step
    assert len(llm.engine.runner.sampler.grammars) == 0  # every matcher dropped


def test_seeded_sampling_under_a_grammar_identical_with_overlap(tiny_qwen_dir):
    prompts = random_prompts(512, [4, 10, 7], seed=22)
    plist = [params(k, temperature=1.0, seed=5) for k in ("json_schema", "regex", "grammar")]
    runs = [
        [o.token_ids for o in make_llm(tiny_qwen_dir, scheduler={"overlap": ov}).generate_ids(prompts, plist)]
        for ov in (False, True)
    ]
    assert runs[0] == runs[1]


def test_compiling_off_the_hot_path(tiny_qwen_dir, monkeypatch):
    """A request whose grammar is compiling waits outside the scheduler; others decode."""
    gate = threading.Event()
    compiled = []
    original = GrammarCompiler._compile

    def slow(self, so):
        gate.wait(30)
        compiled.append(so)
        return original(self, so)

    monkeypatch.setattr(GrammarCompiler, "_compile", slow)
    llm = make_llm(tiny_qwen_dir)
    engine = llm.engine
    so = StructuredOutput.regex(r"[0-9]{4}")
    llm.add_request("plain", [5, 6, 7], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    llm.add_request("constrained", [5, 6, 7], SamplingParams(max_tokens=8, temperature=0.0, structured_output=so))
    done = {}
    while "plain" not in done:
        done.update({o.request_id: o for o in llm.step()})
    assert "constrained" not in done and len(engine.grammar_wait) == 1 and not compiled
    gate.set()
    llm.add_request("again", [9, 9], SamplingParams(max_tokens=8, temperature=0.0, structured_output=so))
    while engine.has_unfinished():
        done.update({o.request_id: o for o in llm.step()})
    assert re.fullmatch(r"[0-9]{4}", done["constrained"].text)
    assert re.fullmatch(r"[0-9]{4}", done["again"].text)
    assert compiled == [so]  # compiled once, cached by the constraint
