"""The incremental tool-call and reasoning parsers on crafted text, fed whole and in every
kind of split (the streaming parser and the non-streaming result must agree)."""

from __future__ import annotations

import json
import random

import pytest

from cluster.api.chat_output import ChatOutputSpec, parse_message
from cluster.api.reasoning import ReasoningSplitter, prompt_opens_reasoning
from cluster.api.tool_parsers import convert_value, make_tool_parser, parameter_types, pick_tool_parser
from tests.cluster.api.scripted_model import TOOLS

HERMES = (
    "Let me check.\n\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "n": {"a": [1, "}"]}}}'
    '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
)
HERMES_CALLS = [("get_weather", '{"city": "Paris", "n": {"a": [1, "}"]}}'), ("get_time", "{}")]
XML = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
    "</parameter>\n</function>\n</tool_call>"
)
TYPES = parameter_types(TOOLS)


def run(parser, pieces: list[str]):
    """(content, [(name, arguments)]) from feeding ``pieces``; checks the delta shapes."""
    content, calls = "", {}
    for d in [parser.feed(p) for p in pieces] + [parser.finish()]:
        content += d.content
        for c in d.tool_calls:
            if c.id is not None:
                assert c.index not in calls and c.arguments == "" and c.name
                calls[c.index] = [c.name, ""]
            else:
                assert c.name is None and c.arguments
                calls[c.index][1] += c.arguments
    return content, [tuple(calls[i]) for i in sorted(calls)]


def splits(text: str, seed: int, count: int = 300):
    rnd = random.Random(seed)
    for _ in range(count):
        cuts = sorted(rnd.sample(range(1, len(text)), rnd.randint(1, min(20, len(text) - 1))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    yield list(text)  # one character at a time


@pytest.mark.parametrize(
    "name,text,expected",
    [
        ("hermes", HERMES, ("Let me check.\n\n", HERMES_CALLS)),
        ("qwen3_xml", XML, ("", [("get_weather", '{"city": "Paris", "days": 3}')])),
    ],
)
def test_any_split_gives_the_whole_text_result(name, text, expected):
    assert run(make_tool_parser(name, TYPES), [text]) == expected
    for pieces in splits(text, seed=len(text)):
        assert run(make_tool_parser(name, TYPES), pieces) == expected, pieces
    for _, args in expected[1]:
        json.loads(args)


def test_arguments_stream_before_the_call_closes():
    parser = make_tool_parser("hermes")
    head = parser.feed('<tool_call>\n{"name": "f", "arguments": {"a": "long ')
    assert [(c.name, c.arguments) for c in head.tool_calls] == [("f", ""), (None, '{"a": "long')]
    more = parser.feed('text"}}\n</tool')
    assert [c.arguments for c in more.tool_calls] == [' text"}']  # the outer } is held back
    assert parser.feed("_call>").tool_calls == [] and parser.num_calls == 1


@pytest.mark.parametrize(
    "text,content,calls",
    [
        # a partial tag at the end
        ("no tools here <tool", "no tools here <tool", []),
        # malformed: content
        ("<tool_call>\n{bad json}\n</tool_call>", "<tool_call>\n{bad json}\n</tool_call>", []),
        # cut off, nothing sent
        ('<tool_call>\n{"name": "f", "argu', '<tool_call>\n{"name": "f", "argu', []),
        # string args
        ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "", [("f", '{"a": 1}')]),
        ('<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>', "", [("f", '{"a": 1}')]),  # name last
        ('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call> and then?', " and then?", [("f", '{"a": 1}')]),
    ],
)
def test_hermes_edges(text, content, calls):
    assert run(make_tool_parser("hermes"), [text]) == (content, calls)


def test_xml_values_follow_the_schema_types():
    types = {"integer": "integer", "number": "number", "boolean": "boolean", "object": "object", "array": "array"}
    assert convert_value("\n3\n", "integer") == 3 and convert_value("\n2.5\n", "number") == 2.5
    assert convert_value("\ntrue\n", "boolean") is True and convert_value("\n[1, 2]\n", "array") == [1, 2]
    assert convert_value('\n{"k": 1}\n', "object") == {"k": 1}
    assert convert_value("\nthree\n", "integer") == "three"  # does not parse: a string
    assert convert_value("\n1\n", "boolean") == "1" and convert_value("\ntrue\n", "integer") == "true"
    assert convert_value("\n  Paris \n", "string") == "  Paris " and convert_value("\n007\n", None) == "007"
    text = (
        "<tool_call><function=f>"
        + "".join(
            f"<parameter={k}>\n{v}\n</parameter>"
            for k, v in [("integer", "4"), ("number", "1e3"), ("boolean", "false"), ("object", "{}"), ("array", "[]")]
        )
        + "</function></tool_call>"
    )
    _, calls = run(make_tool_parser("qwen3_xml", {"f": types}), [text])
    assert json.loads(calls[0][1]) == {"integer": 4, "number": 1000.0, "boolean": False, "object": {}, "array": []}
    assert run(make_tool_parser("qwen3_xml"), ["<tool_call><function=g></function></tool_call>"]) == ("", [("g", "{}")])


def test_parser_is_picked_from_the_template_or_the_config():
    assert pick_tool_parser("auto", "... <tool_call>\n<function=NAME> ...") == "qwen3_xml"
    assert pick_tool_parser("auto", '... <tool_call>\n{"name": ...') == "hermes"
    assert pick_tool_parser("auto", "{{ messages }}") is None and pick_tool_parser("auto", None) is None
    assert pick_tool_parser("hermes", None) == "hermes" and pick_tool_parser("none", "<tool_call>") is None


@pytest.mark.parametrize(
    "text,starts_open,expected",
    [
        ("<think>\nI think.\n</think>\n\nThe answer.", False, ("I think.\n", "The answer.")),
        ("  <think>x</think>y", False, ("x", "y")),
        ("Plain answer <think>not here</think>", False, ("", "Plain answer <think>not here</think>")),
        ("I reason.</think>\n\nAnswer", True, ("I reason.", "Answer")),
        ("<think>cut off", False, ("cut off", "")),
        ("still thinking", True, ("still thinking", "")),
        ("  <thi", False, ("", "  <thi")),
    ],
)
def test_reasoning_split(text, starts_open, expected):
    def split(pieces):
        s = ReasoningSplitter(starts_open)
        parts = [s.feed(p) for p in pieces] + [s.finish()]
        return "".join(r for r, _ in parts), "".join(c for _, c in parts)

    assert split([text]) == expected
    for pieces in splits(text, seed=7, count=100):
        assert split(pieces) == expected, pieces


def test_prompt_opens_reasoning():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")


def test_message_from_reasoning_and_calls():
    spec = ChatOutputSpec(reasoning=True, tool_parser="hermes")
    message, called = parse_message(spec, "<think>hmm</think>\n\n" + HERMES)
    assert called and message["reasoning_content"] == "hmm" and message["content"] == "Let me check.\n\n"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == HERMES_CALLS
    only_calls, _ = parse_message(spec, HERMES[len("Let me check.") :])
    assert only_calls["content"] is None and only_calls["reasoning_content"] is None
    first, _ = parse_message(ChatOutputSpec(tool_parser="hermes", parallel_tool_calls=False), HERMES)
    assert len(first["tool_calls"]) == 1
    hidden, _ = parse_message(ChatOutputSpec(reasoning=True, include_reasoning=False), "<think>x</think>y")
    assert hidden == {"role": "assistant", "content": "y", "reasoning_content": None}


def test_forced_schema_for_a_named_function_and_required():
    from cluster.api.tool_choice import forced_schema

    params = TOOLS[0]["function"]["parameters"]
    assert forced_schema(TOOLS, "get_weather", True) == params
    required = forced_schema(TOOLS, None, parallel=False)
    assert required["type"] == "array" and required["minItems"] == required["maxItems"] == 1
    names = [item["properties"]["name"]["enum"] for item in required["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]] and "maxItems" not in forced_schema(TOOLS, None, True)
    nested = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {
                    "type": "object",
                    "properties": {"p": {"$ref": "#/$defs/P"}},
                    "$defs": {"P": {"type": "integer"}},
                },
            },
        }
    ]
    assert forced_schema(nested, "f", True)["$defs"] == {"P": {"type": "integer"}}
    assert forced_schema(nested, None, True)["$defs"] == {"P": {"type": "integer"}}
    clash = nested + [{"type": "function", "function": {"name": "g", "parameters": {"$defs": {"P": {}}}}}]
    with pytest.raises(Exception, match="differently"):
        forced_schema(clash, None, True)


@pytest.mark.parametrize(
    "named,text,expected",
    [
        ("get_weather", '{"city": "Paris"}', [("get_weather", '{"city": "Paris"}')]),
        (
            None,
            '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]',
            [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")],
        ),
    ],
)
def test_forced_output_reads_as_tool_calls_in_any_split(named, text, expected):
    from cluster.api.tool_choice import ForcedToolParser

    assert run(ForcedToolParser(named), [text]) == ("", expected)
    for pieces in splits(text, seed=3, count=100):
        assert run(ForcedToolParser(named), pieces) == ("", expected)
    spec = ChatOutputSpec(reasoning=False, forced=True, forced_name=named)
    message, called = parse_message(spec, text)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == expected
    assert message["content"] is None and called == (named is None)  # a forced function is no choice
