"""SSE chunk rendering and response accumulation (pure; a fake tokenizer)."""

from __future__ import annotations

import json

from cluster.api.openai_service import OpenAIError, PreparedRequest
from cluster.api.streaming import DONE_EVENT, ResponseState, SSERenderer
from cluster.serving.messages import GenerateChunk
from workers.request import TokenLogprob
from workers.sampling.params import SamplingParams


class FakeTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(f"<{i}>" for i in ids)


def prepared(
    kind: str, n: int = 1, prompts: int = 1, logprobs: int | None = None, token_ids: bool = False
) -> PreparedRequest:
    prompt_ids = [[1, 2, 3]] * prompts
    return PreparedRequest(kind, prompt_ids, [SamplingParams()] * (n * prompts), n, token_ids, logprobs)


def chunk(
    index: int, ids: list[int], text: str, finished: bool = False, lps: bool = False, cached: int = 0
) -> GenerateChunk:
    return GenerateChunk(
        index,
        ids,
        text,
        [TokenLogprob(t, -0.5, [(t, -0.5)]) for t in ids] if lps else None,
        finished,
        "length" if finished else None,
        None,
        cached,
    )


def decode(events: list[str]) -> list[object]:
    out = []
    for e in events:
        assert e.startswith("data: ") and e.endswith("\n\n")
        body = e[len("data: ") : -2]
        out.append(body if body == "[DONE]" else json.loads(body))
    return out


def test_chat_stream_role_first_then_content_finish_usage_and_done():
    p = prepared("chat")
    state = ResponseState(p)
    r = SSERenderer(p, "m", "chatcmpl-x", FakeTokenizer(), include_usage=True, created=7)
    events = r.first_events(1)
    events += r.delta_events(state.absorb(0, [chunk(0, [5], "he", cached=2)]))
    events += r.delta_events(state.absorb(0, [chunk(0, [6], "llo"), chunk(0, [7], "!", finished=True)]))
    events += r.final_events(state)
    objs = decode(events)
    assert objs[-1] == "[DONE]" and events[-1] == DONE_EVENT
    first, c1, c2, usage = objs[:4]
    assert first["object"] == "chat.completion.chunk" and first["created"] == 7
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert c1["choices"][0]["delta"] == {"content": "he"} and c1["usage"] is None
    # two chunks of one batch merge into one event; finish_reason rides on the last content
    assert c2["choices"][0] == {
        "index": 0,
        "delta": {"content": "llo!"},
        "logprobs": None,
        "finish_reason": "length",
        "stop_reason": None,
    }
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 2},
    }


def test_completion_stream_logprobs_offsets_token_ids_and_no_usage():
    p = prepared("completion", logprobs=1, token_ids=True)
    state = ResponseState(p)
    r = SSERenderer(p, "m", "cmpl-x", FakeTokenizer(), include_usage=False)
    assert r.first_events(1) == []
    e1 = decode(r.delta_events(state.absorb(0, [chunk(0, [5], "ab", lps=True)])))[0]
    e2 = decode(r.delta_events(state.absorb(0, [chunk(0, [6], "cd", finished=True, lps=True)])))[0]
    assert "usage" not in e1
    c1, c2 = e1["choices"][0], e2["choices"][0]
    assert c1["text"] == "ab" and c1["prompt_token_ids"] == [1, 2, 3] and c1["token_ids"] == [5]
    assert c1["logprobs"]["tokens"] == ["<5>"] and c1["logprobs"]["text_offset"] == [0]
    # offsets count the tokens' texts before (here "<5>"), as the non-streamed body does, not the
    # text streamed so far (which lags when the detokenizer holds back a partial character)
    assert c2["logprobs"]["text_offset"] == [3] and "prompt_token_ids" not in c2
    assert c2["finish_reason"] == "length" and c2["stop_reason"] is None
    assert decode(r.final_events(state)) == ["[DONE]"]


def test_n_and_batched_prompts_map_to_global_choice_indices():
    p = prepared("completion", n=2, prompts=2)
    state = ResponseState(p)
    deltas = state.absorb(1, [chunk(1, [9], "x", finished=True), chunk(0, [8], "y")])
    assert [d.index for d in deltas] == [2, 3]
    outs = state.outputs()
    assert outs[3].text == "x" and outs[3].finish_reason == "length" and outs[2].text == "y"
    assert not state.finished


def test_empty_deltas_are_skipped_and_errors_render_in_band():
    p = prepared("chat")
    state = ResponseState(p)
    r = SSERenderer(p, "m", "id", FakeTokenizer(), include_usage=False)
    assert r.delta_events(state.absorb(0, [chunk(0, [5], "")])) == []  # held-back text
    err = decode(r.error_events(OpenAIError("boom", status=503, type="service_unavailable")))
    assert err[0] == {"error": {"message": "boom", "type": "service_unavailable", "param": None, "code": None}}
    assert err[1] == "[DONE]"
