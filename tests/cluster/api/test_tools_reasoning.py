"""Tool calls, reasoning and chat-template options over HTTP, in process (no Ray).

The scripted checkpoints (``scripted_model.py``) emit a known text, so the whole path
-- template, engine, detokenizer, parsers, stream rendering -- is checked on real output.
"""

from __future__ import annotations

import json

import pytest

from tests.cluster.api.conftest import sse_objects
from tests.cluster.api.scripted_model import (
    CONTINUE,
    HERMES_ANSWER,
    HERMES_CALLS,
    HERMES_REASONING,
    TOOLS,
    WEATHER_TOOL,
    XML_CALLS,
    XML_REASONING,
)

USER = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def hermes(local_app, scripted_hermes_dir):
    return local_app(scripted_hermes_dir, "scripted")


@pytest.fixture(scope="module")
def xml(local_app, scripted_xml_dir):
    return local_app(scripted_xml_dir, "scripted-xml")


def chat(app, **body):
    r = app.call("POST", CHAT, json={"messages": USER, "max_tokens": 64, **body})
    assert r.status_code == 200, r.text
    return r.json()


def stream(app, **body):
    r = app.call("POST", CHAT, json={"messages": USER, "max_tokens": 64, "stream": True, **body})
    assert r.status_code == 200, r.text
    return sse_objects(r.text)


def calls_of(message):
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]


def assemble(objs):
    """What a client rebuilds from the stream: reasoning, content, calls, finish_reason."""
    reasoning, content, calls, finish = "", "", {}, None
    for o in objs[:-1]:
        for ch in o["choices"]:
            d = ch["delta"]
            reasoning += d.get("reasoning_content") or ""
            content += d.get("content") or ""
            for c in d.get("tool_calls", []):
                if "id" in c:
                    assert c["index"] not in calls and c["type"] == "function"
                    assert c["function"]["arguments"] == ""
                    calls[c["index"]] = {"id": c["id"], "name": c["function"]["name"], "args": ""}
                else:
                    assert set(c) == {"index", "function"} and set(c["function"]) == {"arguments"}
                    calls[c["index"]]["args"] += c["function"]["arguments"]
            finish = ch["finish_reason"] or finish
    return reasoning, content, [(calls[i]["name"], calls[i]["args"]) for i in sorted(calls)], finish


def test_tool_calls_and_reasoning_split_non_streamed(hermes):
    body = chat(hermes, tools=TOOLS)
    choice = body["choices"][0]
    message = choice["message"]
    assert message["reasoning_content"] == HERMES_REASONING
    assert calls_of(message) == HERMES_CALLS and message["content"] is None
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in message["tool_calls"])
    assert choice["finish_reason"] == "tool_calls"
    assert [json.loads(a) for _, a in calls_of(message)] == [{"city": "Paris", "days": 3}, {"zone": "CET"}]


def test_tool_calls_stream_as_openai_deltas(hermes):
    objs = stream(hermes, tools=TOOLS, stream_options={"include_usage": True})
    reasoning, content, calls, finish = assemble(objs)
    assert (reasoning, content, calls, finish) == (HERMES_REASONING, "", HERMES_CALLS, "tool_calls")
    fragments = [
        c for o in objs[:-1] for ch in o["choices"] for c in ch["delta"].get("tool_calls", []) if "id" not in c
    ]
    assert len(fragments) >= 2  # arguments arrive after the name
    assert objs[-2]["usage"]["completion_tokens"] == chat(hermes, tools=TOOLS)["usage"]["completion_tokens"]


def test_parallel_tool_calls_false_keeps_the_first(hermes):
    body = chat(hermes, tools=TOOLS, parallel_tool_calls=False)
    assert calls_of(body["choices"][0]["message"]) == HERMES_CALLS[:1]
    assert assemble(stream(hermes, tools=TOOLS, parallel_tool_calls=False))[2] == HERMES_CALLS[:1]


def test_tool_choice_none_leaves_the_text_alone(hermes):
    message = chat(hermes, tools=TOOLS, tool_choice="none")["choices"][0]["message"]
    assert "tool_calls" not in message
    assert message["content"].startswith('<tool_call>\n{"name": "get_weather"')
    assert message["reasoning_content"] == HERMES_REASONING
    assert chat(hermes, tools=TOOLS, include_reasoning=False)["choices"][0]["message"]["reasoning_content"] is None


def test_chat_template_kwargs_turn_thinking_off(hermes):
    body = chat(hermes, tools=TOOLS, chat_template_kwargs={"enable_thinking": False})
    message = body["choices"][0]["message"]
    assert message == {"role": "assistant", "content": HERMES_ANSWER, "reasoning_content": None}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert assemble(stream(hermes, chat_template_kwargs={"enable_thinking": False}))[:2] == ("", HERMES_ANSWER)


def test_continue_final_message_continues_it(hermes):
    messages = USER + [{"role": "assistant", "content": CONTINUE}]
    body = chat(hermes, messages=messages, continue_final_message=True, add_generation_prompt=False)
    assert body["choices"][0]["message"]["content"] == " the forecast for you."
    r = hermes.call("POST", CHAT, json={"messages": messages, "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_xml_tool_calls_typed_by_the_schema_and_reasoning_opened_by_the_template(xml):
    body = chat(xml, tools=[WEATHER_TOOL])
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == XML_REASONING and calls_of(message) == XML_CALLS
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris", "days": 3}
    assert assemble(stream(xml, tools=[WEATHER_TOOL])) == (XML_REASONING, "", XML_CALLS, "tool_calls")


def test_tool_turns_reach_the_template(hermes, xml):
    history = USER + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    hermes_call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    for app, shown in (
        (hermes, hermes_call),
        (xml, "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>"),
    ):
        ids = app.call("POST", "/tokenize", json={"messages": history, "tools": TOOLS}).json()["tokens"]
        text = app.call("POST", "/detokenize", json={"tokens": ids}).json()["prompt"]
        assert shown in text and "<tool_response>\nsunny\n</tool_response>" in text
        assert '"name": "get_time"' in text  # the tools, in the system turn
    bad = [
        *history[:1],
        {
            **history[1],
            "tool_calls": [{**history[1]["tool_calls"][0], "function": {"name": "f", "arguments": "{oops"}}],
        },
    ]
    r = hermes.call("POST", CHAT, json={"messages": bad})
    assert r.json()["error"]["param"] == "messages.1.tool_calls.0.function.arguments"


def test_per_request_chat_template_needs_the_server_to_trust_it(hermes):
    template = "{{ 'Q: ' + messages[-1].content + ' A:' }}"
    r = hermes.call("POST", CHAT, json={"messages": USER, "chat_template": template})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    trusting = hermes.with_settings(trust_request_chat_template=True)
    ids = trusting.call("POST", "/tokenize", json={"messages": USER, "chat_template": template}).json()["tokens"]
    assert trusting.call("POST", "/detokenize", json={"tokens": ids}).json()["prompt"] == f"Q: {USER[0]['content']} A:"
    body = trusting.call(
        "POST", CHAT, json={"messages": USER, "chat_template": template, "max_tokens": 2, "return_token_ids": True}
    ).json()
    assert body["prompt_token_ids"] == ids


UNITS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {
                "type": "object",
                "properties": {"unit": {"enum": ["c", "f"]}},
                "required": ["unit"],
                "additionalProperties": False,
            },
        },
    }
    for name in ("set_unit", "show_unit")
]


def test_a_named_function_is_enforced(hermes):
    choice = {"type": "function", "function": {"name": "show_unit"}}
    body = chat(hermes, tools=UNITS, tool_choice=choice, temperature=0)
    message = body["choices"][0]["message"]
    [(name, args)] = calls_of(message)
    assert name == "show_unit" and json.loads(args) in ({"unit": "c"}, {"unit": "f"})
    # forced: no choice made
    assert message["content"] is None and body["choices"][0]["finish_reason"] == "stop"
    assert assemble(stream(hermes, tools=UNITS, tool_choice=choice, temperature=0)) == ("", "", [(name, args)], "stop")


def test_tool_choice_required_is_enforced(hermes):
    for parallel in (True, False):
        body = chat(
            hermes, tools=UNITS, tool_choice="required", parallel_tool_calls=parallel, max_tokens=120, temperature=0
        )
        found = calls_of(body["choices"][0]["message"])
        assert found and all(
            n in ("set_unit", "show_unit") and json.loads(a) in ({"unit": "c"}, {"unit": "f"}) for n, a in found
        )
        finish = body["choices"][0]["finish_reason"]
        # one call closes the array; parallel calls may run on to max_tokens (the complete ones count)
        assert (len(found), finish) == (1, "tool_calls") if not parallel else finish in ("tool_calls", "length")
        streamed = assemble(
            stream(
                hermes, tools=UNITS, tool_choice="required", parallel_tool_calls=parallel, max_tokens=120, temperature=0
            )
        )
        assert streamed == ("", "", found, finish)
    r = hermes.call(
        "POST", CHAT, json={"messages": USER, "tools": UNITS, "tool_choice": "required", "guided_regex": "a+"}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


@pytest.mark.parametrize(
    "body,param",
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"reasoning_effort": "low"}, "reasoning_effort"),
        ({"documents": [{"title": "a", "text": "b"}]}, "documents"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "look"},
                            {"type": "image_url", "image_url": {"url": "http://x/a.png"}},
                        ],
                    }
                ]
            },
            "messages.0.content.1",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
            "messages.0.content.0.type",
        ),
    ],
)
def test_what_is_not_served_is_a_400_naming_it(hermes, body, param):
    for streamed in (False, True):
        r = hermes.call("POST", CHAT, json={"messages": USER, **body, "stream": streamed})
        assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), r.text
        assert r.json()["error"]["param"] == param, r.text


def test_images_say_they_are_not_served_yet(hermes):
    r = hermes.call(
        "POST",
        CHAT,
        json={
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}
            ]
        },
    )
    assert "images are not served yet" in r.json()["error"]["message"]


def test_tools_on_a_model_without_a_tool_format_are_refused(local_app, tiny_qwen_dir):
    plain = local_app(tiny_qwen_dir)
    r = plain.call("POST", CHAT, json={"messages": USER, "tools": TOOLS})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert (
        plain.call(
            "POST", CHAT, json={"messages": USER, "tools": TOOLS, "tool_choice": "none", "max_tokens": 2}
        ).status_code
        == 200
    )
    forced = plain.with_settings(tool_call_parser="hermes")  # config server.tool_call_parser
    assert forced.call("POST", CHAT, json={"messages": USER, "tools": TOOLS, "max_tokens": 2}).status_code == 200


def test_documents_and_reasoning_effort_reach_a_template_that_reads_them(hermes):
    trusting = hermes.with_settings(trust_request_chat_template=True)
    template = "{{ 'effort=' + reasoning_effort + ' doc=' + documents[0].text + ' q=' + messages[-1].content }}"
    ids = trusting.call(
        "POST",
        "/tokenize",
        json={
            "messages": USER,
            "chat_template": template,
            "reasoning_effort": "high",
            "documents": [{"title": "t", "text": "the manual"}],
        },
    ).json()["tokens"]
    text = trusting.call("POST", "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text == f"effort=high doc=the manual q={USER[0]['content']}"


def test_images_on_a_vision_checkpoint_say_its_tower_is_not_loaded(local_app, tiny_checkpoint):
    vl = local_app(tiny_checkpoint("qwen3_5_vl"), "vl")
    assert vl.server.chat_setup.unserved_vision
    r = vl.call(
        "POST",
        CHAT,
        json={
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {"type": "image_url", "image_url": {"url": "data:,"}},
                    ],
                }
            ]
        },
    )
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "messages.0.content.1"
    assert "images are not served yet" in err["message"] and "vision tower" in err["message"]
    # text is served
    assert vl.call("POST", CHAT, json={"messages": USER, "max_tokens": 2}).status_code == 200
