"""Tiny checkpoints whose greedy output is a known text: tool calls and reasoning end to end.

The tiny model is a real Qwen3-Next checkpoint the engine serves, built so that its next
token depends only on the current one: every layer's output projection is zero (the
residual stream stays the token's embedding), the script's tokens have orthogonal
embeddings, and ``lm_head`` maps each to its successor by a wide margin. Each script
piece is one added (non-special) token of the tiny tokenizer, so a script is a chain
``entry -> piece 1 -> ... -> piece k -> EOS``, where ``entry`` is the token a prompt ends
with. Its probability is ~1, so it comes out under any sampling settings.

Two checkpoints, as the two Qwen3 tool-call formats come:

- ``hermes`` (Qwen3-style template: tools in ``<tools>``, JSON in ``<tool_call>``; the
  generation prompt ends ``assistant\\n``, or with an empty think block when
  ``enable_thinking`` is false): thinking -> reasoning then two tool calls; no thinking ->
  a plain answer; ``continue_final_message`` after "Let me check" -> its continuation.
- ``xml`` (Qwen3.5-style: ``<function=...><parameter=...>``; the generation prompt opens
  the think block itself): reasoning then one XML tool call.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tools.tiny import _hf_model, _save_quietly, build_tiny_tokenizer, tiny_config
from tools.tiny_text import EOS_TOKEN, SPECIAL_TOKENS

NO_THINK = "<think>\n\n</think>\n\n"
CONTINUE = "Let me check"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}},
}
TOOLS = [WEATHER_TOOL, TIME_TOOL]

HERMES_SCRIPTS: dict[str, list[str]] = {
    "assistant\n": [
        "<think>",
        "\nThe user wants the weather and the time.",
        "\n</think>",
        "\n\n",
        "<tool_call>",
        '\n{"name": "get_weather", "arguments": ',
        '{"city": "Paris", "days": 3}',
        "}\n</tool_call>",
        "\n<tool_call>",
        '\n{"name": "get_time", "arguments": ',
        '{"zone": "CET"}',
        "}\n</tool_call>\n",
    ],
    NO_THINK: ["The weather in Paris", " is sunny."],
    CONTINUE: [" the forecast", " for you."],
}
XML_SCRIPTS: dict[str, list[str]] = {
    "assistant\n<think>\n": [
        "I will look it up.",
        "\n</think>\n\n",
        "<tool_call>",
        "\n<function=get_weather>",
        "\n<parameter=city>",
        "\nParis",
        "\n</parameter>",
        "\n<parameter=days>",
        "\n3",
        "\n</parameter>\n</function>",
        "\n</tool_call>",
    ]
}
# what the scripts produce, as the API should return them
HERMES_REASONING = "The user wants the weather and the time.\n"
HERMES_CALLS = [("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", '{"zone": "CET"}')]
HERMES_ANSWER = "The weather in Paris is sunny."
XML_REASONING = "I will look it up.\n"
XML_CALLS = [("get_weather", '{"city": "Paris", "days": 3}')]

_SYSTEM = (
    "{%- if messages[0].role == 'system' %}{{ '<|im_start|>system\\n' + messages[0].content }}"
    "{%- if tools %}{{ '\\n\\n' }}{%- endif %}"
    "{%- elif tools %}{{ '<|im_start|>system\\n' }}{%- endif %}"
)
_TOOLS = (
    "{%- if tools %}{{ '# Tools\\n<tools>' }}{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}"
    "{%- endfor %}{{ '\\n</tools>\\n' + CALL_HELP }}{%- endif %}"
    "{%- if tools or messages[0].role == 'system' %}{{ '<|im_end|>\\n' }}{%- endif %}"
)
_TURNS = (
    "{%- for m in messages %}{%- if m.role == 'system' and loop.first %}"
    "{%- elif m.role == 'tool' %}{{ '<|im_start|>user\\n<tool_response>\\n' + m.content "
    "+ '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}{{ '<|im_start|>assistant\\n' + m.content }}"
    "{%- for tc in m.tool_calls or [] %}CALL{%- endfor %}{{ '<|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
)
HERMES_TEMPLATE = (
    (_SYSTEM + _TOOLS).replace(
        "CALL_HELP",
        '\'Call a tool as <tool_call>\\n{"name": <name>, "arguments": <args-json-object>}\\n</tool_call>\\n\'',
    )
    + _TURNS.replace(
        "CALL",
        '{{ \'\\n<tool_call>\\n{"name": "\' + tc.function.name + \'", "arguments": \' '
        "+ (tc.function.arguments | tojson) + '}\\n</tool_call>' }}",
    )
    + "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '"
    + NO_THINK.replace("\n", "\\n")
    + "' }}{%- endif %}{%- endif %}"
)
XML_TEMPLATE = (
    (_SYSTEM + _TOOLS).replace(
        "CALL_HELP",
        "'Call a tool as <tool_call>\\n<function=NAME>\\n<parameter=KEY>"
        "\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>\\n'",
    )
    + _TURNS.replace(
        "CALL",
        "{{ '\\n<tool_call>\\n<function=' + tc.function.name + '>' }}"
        "{%- for k, v in tc.function.arguments | items %}"
        "{{ '\\n<parameter=' + k + '>\\n' + (v | string) + '\\n</parameter>' }}"
        "{%- endfor %}"
        "{{ '\\n</function>\\n</tool_call>' }}",
    )
    + "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)


def _add_tokens(out: Path, texts: list[str]) -> None:
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in texts])
    tok.save(str(out / "tokenizer.json"))


def _set_template(out: Path, template: str) -> None:
    import json

    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = template
    path.write_text(json.dumps(config, indent=2) + "\n")


def make_scripted_checkpoint(kind: str, out_dir: str | Path) -> Path:
    """``kind``: ``hermes`` or ``xml`` (see the module docstring)."""
    scripts, template = {"hermes": (HERMES_SCRIPTS, HERMES_TEMPLATE), "xml": (XML_SCRIPTS, XML_TEMPLATE)}[kind]
    out = Path(out_dir)
    build_tiny_tokenizer(out)
    chain = [t for entry, pieces in scripts.items() for t in (entry, *pieces)]
    assert len(set(chain)) == len(chain), "every script token must be unique"
    _add_tokens(out, chain)
    _set_template(out, template)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    ids = {t: tok.convert_tokens_to_ids(t) for t in chain}
    eos = SPECIAL_TOKENS.index(EOS_TOKEN)
    cfg = tiny_config("qwen3_next", len(tok), eos)
    assert len(chain) <= cfg.hidden_size, "one embedding direction per script token"
    model = _hf_model("qwen3_next", cfg, seed=0)
    successors = _successors(scripts, ids, eos)
    _wire(model, successors, [ids[t] for t in chain])
    _save_quietly(model, out, 1 << 40)
    for path in out.glob("*.safetensors"):
        path.chmod(0o644)
    return out


def _successors(scripts: dict[str, list[str]], ids: dict[str, int], eos: int) -> dict[int, int]:
    out = {}
    for entry, pieces in scripts.items():
        seq = [ids[entry], *(ids[p] for p in pieces), eos]
        out.update(zip(seq[:-1], seq[1:]))
    return out


@torch.no_grad()
def _wire(model: torch.nn.Module, successors: dict[int, int], chain_ids: list[int]) -> None:
    """Residual stream = the token's embedding; token k of the chain -> basis vector k;
    ``lm_head`` gives its successor a logit of 80 and every other token 0."""
    for name, p in model.named_parameters():
        if any(k in name for k in ("o_proj", "out_proj", "down_proj")):
            p.zero_()
    model.model.norm.weight.zero_()  # zero-centered RMSNorm: scale 1
    emb, head = model.model.embed_tokens.weight, model.lm_head.weight
    head.zero_()
    for k, tid in enumerate(chain_ids):
        emb[tid] = 0.0
        emb[tid, k] = 1.0
        if tid in successors:
            head[successors[tid], k] = 10.0
