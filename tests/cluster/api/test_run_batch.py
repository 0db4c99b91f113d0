"""`hybridserve run-batch` end to end through the CLI, compared with the LLM API."""

from __future__ import annotations

import json

import pytest

from cluster.cli import main
from tests.workers.engine.helpers import make_llm
from workers.sampling.params import SamplingParams


def line(cid, url, body):
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


@pytest.fixture(scope="module")
def batch_result(tiny_qwen_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("batch")
    lines = [
        line(
            "c1",
            "/v1/completions",
            {
                "model": "m",
                "prompt": "def add(a, b):",
                "max_tokens": 10,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        ),
        "{not json",
        line(
            "chat",
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 8,
                "temperature": 0,
                "return_token_ids": True,
                "logprobs": True,
                "top_logprobs": 2,
            },
        ),
        line("badurl", "/v1/embeddings", {"input": "x"}),
        line("bad_max", "/v1/completions", {"prompt": "x", "max_tokens": 0}),
        line("bad_temp", "/v1/completions", {"prompt": "x", "temperature": -1}),
        line("too_long", "/v1/completions", {"prompt": [5] * 100000, "max_tokens": 4}),
        line(
            "n2",
            "/v1/completions",
            {
                "prompt": [7, 8, 9],
                "max_tokens": 6,
                "n": 2,
                "seed": 3,
                "temperature": 1.0,
                "ignore_eos": True,
                "logprobs": 2,
            },
        ),
    ]
    inp, out = d / "in.jsonl", d / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    rc = main(
        [
            "run-batch",
            "-i",
            str(inp),
            "-o",
            str(out),
            "--set",
            f"model={tiny_qwen_dir}",
            "--set",
            "device=cpu",
            "--set",
            "cache.page_size=4",
            "--set",
            "cache.max_kv_tokens=4096",
        ]
    )
    assert rc == 0
    return [json.loads(x) for x in out.read_text().splitlines()]


def test_one_output_per_line_in_order(batch_result):
    assert [r["custom_id"] for r in batch_result] == [
        "c1",
        None,
        "chat",
        "badurl",
        "bad_max",
        "bad_temp",
        "too_long",
        "n2",
    ]


def test_errors_are_openai_objects(batch_result):
    by_id = {r["custom_id"]: r for r in batch_result}
    for cid, param in [
        ("badurl", "url"),
        ("bad_max", "max_tokens"),
        ("bad_temp", "temperature"),
        ("too_long", "prompt"),
    ]:
        resp = by_id[cid]["response"]
        assert resp["status_code"] == 400, cid
        err = resp["body"]["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, (cid, err)
    assert batch_result[1]["response"]["status_code"] == 400


def test_completion_matches_llm_api(batch_result, tiny_qwen_dir):
    body = batch_result[0]["response"]["body"]
    assert batch_result[0]["response"]["status_code"] == 200
    llm = make_llm(tiny_qwen_dir)
    ref = llm.generate("def add(a, b):", SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    choice = body["choices"][0]
    assert choice["token_ids"] == ref.token_ids and choice["text"] == ref.text
    assert body["prompt_token_ids"] == ref.prompt_token_ids
    assert body["usage"] == {
        "prompt_tokens": len(ref.prompt_token_ids),
        "completion_tokens": 10,
        "total_tokens": len(ref.prompt_token_ids) + 10,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_chat_and_n(batch_result):
    chat = batch_result[2]["response"]["body"]
    assert chat["object"] == "chat.completion"
    msg = chat["choices"][0]
    assert msg["message"]["role"] == "assistant" and isinstance(msg["message"]["content"], str)
    assert len(msg["logprobs"]["content"]) == len(msg["token_ids"])
    assert all(len(e["top_logprobs"]) == 2 for e in msg["logprobs"]["content"])
    n2 = batch_result[7]["response"]["body"]
    assert [c["index"] for c in n2["choices"]] == [0, 1]
    assert n2["usage"]["completion_tokens"] == 12
    assert len(n2["choices"][0]["logprobs"]["tokens"]) == 6


def test_tool_calls_reasoning_and_refusals_offline(scripted_hermes_dir, tmp_path):
    """run-batch reads chat outputs as the server does (its config's parsers)."""
    from tests.cluster.api.scripted_model import HERMES_CALLS, HERMES_REASONING, TOOLS

    user = [{"role": "user", "content": "weather?"}]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(
        "\n".join(
            [
                line("tools", "/v1/chat/completions", {"messages": user, "tools": TOOLS, "max_tokens": 64}),
                line("bias", "/v1/chat/completions", {"messages": user, "suffix": "x", "audio": {"voice": "a"}}),
                line("surrogate", "/v1/completions", {"prompt": "\udcff"}),
            ]
        )
        + "\n"
    )
    rc = main(
        [
            "run-batch",
            "-i",
            str(inp),
            "-o",
            str(out),
            "--set",
            f"model={scripted_hermes_dir}",
            "--set",
            "device=cpu",
            "--set",
            "cache.page_size=4",
            "--set",
            "cache.max_kv_tokens=1024",
        ]
    )
    assert rc == 0
    tools, bias, surrogate = [json.loads(x) for x in out.read_text().splitlines()]
    choice = tools["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == HERMES_REASONING
    assert [
        (c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]
    ] == HERMES_CALLS
    assert bias["response"]["status_code"] == 400 and bias["response"]["body"]["error"]["param"] == "audio"
    assert surrogate["response"]["status_code"] == 400
