"""Tool calls and reasoning through Ray Serve with the official ``openai`` client.

Two apps over the scripted checkpoints (``tests/cluster/api/scripted_model.py``: their
greedy output is a known text), one per Qwen3 tool-call format; each parser is picked
from the checkpoint's chat template (``server.tool_call_parser: auto``).
"""

from __future__ import annotations

import json

import openai
import pytest

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

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]
USER = [{"role": "user", "content": "Weather in Paris, and the time?"}]


@pytest.fixture(scope="module")
def hermes(deployed, scripted_hermes_dir):
    app = deployed(
        "tools-hermes",
        str(scripted_hermes_dir),
        args={"model_name": "scripted"},
        overrides={"server": {"trust_request_chat_template": True}},
    )
    return openai.OpenAI(base_url=app.openai_base, api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def xml(deployed, scripted_xml_dir):
    app = deployed("tools-xml", str(scripted_xml_dir), args={"model_name": "scripted-xml"})
    return openai.OpenAI(base_url=app.openai_base, api_key="none", max_retries=0, timeout=60)


def calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def streamed(client, model: str, **kwargs):
    """Reasoning, content, tool calls and finish reason as a client accumulates them."""
    reasoning, content, acc, finish = "", "", {}, None
    for chunk in client.chat.completions.create(model=model, messages=USER, stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                if tc.id is not None:
                    acc[tc.index] = [tc.function.name, ""]
                acc[tc.index][1] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return reasoning, content, [tuple(acc[i]) for i in sorted(acc)], finish


def test_hermes_tool_calls_and_reasoning(hermes):
    out = hermes.chat.completions.create(model="scripted", messages=USER, tools=TOOLS)
    choice = out.choices[0]
    assert calls(choice.message) == HERMES_CALLS and choice.finish_reason == "tool_calls"
    assert choice.message.model_extra["reasoning_content"] == HERMES_REASONING
    assert [json.loads(a) for _, a in calls(choice.message)] == [{"city": "Paris", "days": 3}, {"zone": "CET"}]
    assert streamed(hermes, "scripted", tools=TOOLS) == (HERMES_REASONING, "", HERMES_CALLS, "tool_calls")


def test_chat_template_kwargs_and_tool_turns(hermes):
    out = hermes.chat.completions.create(
        model="scripted", messages=USER, tools=TOOLS, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert out.choices[0].message.content == HERMES_ANSWER and not out.choices[0].message.tool_calls
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
    again = hermes.chat.completions.create(model="scripted", messages=history, tools=TOOLS)
    assert calls(again.choices[0].message) == HERMES_CALLS  # the template took the turns
    forced = hermes.chat.completions.create(
        model="scripted",
        messages=USER,
        tools=TOOLS,
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=40,
    )
    [call] = forced.choices[0].message.tool_calls  # enforced by a JSON-schema constraint
    assert call.function.name == "get_time" and forced.choices[0].message.content is None


def test_xml_tool_calls(xml):
    out = xml.chat.completions.create(model="scripted-xml", messages=USER, tools=[WEATHER_TOOL])
    assert calls(out.choices[0].message) == XML_CALLS
    assert out.choices[0].message.model_extra["reasoning_content"] == XML_REASONING
    assert streamed(xml, "scripted-xml", tools=[WEATHER_TOOL]) == (XML_REASONING, "", XML_CALLS, "tool_calls")


def test_template_options_through_serve(hermes):
    """parallel_tool_calls, include_reasoning, continue_final_message, a request's own template."""
    one = hermes.chat.completions.create(model="scripted", messages=USER, tools=TOOLS, parallel_tool_calls=False)
    assert calls(one.choices[0].message) == HERMES_CALLS[:1]
    hidden = hermes.chat.completions.create(
        model="scripted", messages=USER, tools=TOOLS, extra_body={"include_reasoning": False}
    )
    assert hidden.choices[0].message.model_extra["reasoning_content"] is None
    more = hermes.chat.completions.create(
        model="scripted",
        messages=USER + [{"role": "assistant", "content": CONTINUE}],
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert more.choices[0].message.content == " the forecast for you."
    own = hermes.chat.completions.create(
        model="scripted",
        messages=USER,
        max_tokens=3,
        extra_body={"chat_template": "{{ messages[0].content + ' ' }}", "return_token_ids": True},
    )
    plain = hermes.chat.completions.create(
        model="scripted", messages=USER, max_tokens=3, extra_body={"return_token_ids": True}
    )
    assert own.model_extra["prompt_token_ids"] != plain.model_extra["prompt_token_ids"]
