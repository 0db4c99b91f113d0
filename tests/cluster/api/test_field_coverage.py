"""Every request field is honoured (and a named test shows it), refused with a 400 naming it,
or ignored because it cannot change the output.

The field lists are vLLM's ``CompletionRequest`` / ``ChatCompletionRequest``
(``vllm/entrypoints/openai/protocol.py``: OpenAI's fields, the sampling extras and the
extra params, ``structured_outputs`` and the ``guided_*`` names) and the OpenAI chat fields
vLLM does not model. A field added to our schemas must be classified here too.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest

from cluster.api.errors import OpenAIError
from cluster.api.protocol import ChatCompletionRequest, CompletionRequest, validate_chat, validate_completion
from cluster.api.unsupported import CHAT, COMMON, COMPLETION

VLLM_COMMON = [
    "model",
    "best_of",
    "frequency_penalty",
    "logit_bias",
    "max_tokens",
    "n",
    "presence_penalty",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "user",
    "use_beam_search",
    "top_k",
    "min_p",
    "repetition_penalty",
    "length_penalty",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "truncate_prompt_tokens",
    "allowed_token_ids",
    "prompt_logprobs",
    "bad_words",
    "add_special_tokens",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
    "structural_tag",
    "priority",
    "request_id",
    "logits_processors",
    "return_tokens_as_token_ids",
    "return_token_ids",
    "cache_salt",
    "kv_transfer_params",
    "vllm_xargs",
    "logprobs",
    "echo",
    "mm_processor_kwargs",
]
VLLM_COMPLETION = VLLM_COMMON + ["prompt", "prompt_embeds", "suffix"]
VLLM_CHAT = VLLM_COMMON + [
    "messages",
    "top_logprobs",
    "max_completion_tokens",
    "tools",
    "tool_choice",
    "reasoning_effort",
    "include_reasoning",
    "parallel_tool_calls",
    "add_generation_prompt",
    "continue_final_message",
    "documents",
    "chat_template",
    "chat_template_kwargs",
    # OpenAI's, beyond vLLM's model
    "audio",
    "function_call",
    "functions",
    "metadata",
    "modalities",
    "prediction",
    "service_tier",
    "store",
    "web_search_options",
    "prompt_cache_key",
    "safety_identifier",
    "verbosity",
]

A = "tests/cluster/api/"
HTTP, END, TOOLS = A + "test_http_api.py::", A + "test_endpoints.py::", A + "test_tools_reasoning.py::"
SAMPLING = A + "test_sampling_api.py::"
HONOURED = {
    "model": HTTP + "test_bad_requests_get_an_openai_error_before_any_stream",
    "prompt": HTTP + "test_stream_equals_non_stream_and_cached_tokens_on_repeat",
    "messages": HTTP + "test_chat_uses_the_template_and_streams_roles_first",
    "stream": HTTP + "test_stream_equals_non_stream_and_cached_tokens_on_repeat",
    "stream_options": END + "test_continuous_usage_stats_put_usage_on_every_chunk",
    "max_tokens": END + "test_completions_default_to_the_rest_of_the_context",
    "max_completion_tokens": END + "test_max_completion_tokens_bounds_chat",
    "n": HTTP + "test_n_seed_stop_and_token_ids",
    "seed": HTTP + "test_n_seed_stop_and_token_ids",
    "stop": HTTP + "test_n_seed_stop_and_token_ids",
    "temperature": END + "test_sampling_fields_reach_the_engine_params",
    "top_p": END + "test_sampling_fields_reach_the_engine_params",
    "top_k": END + "test_sampling_fields_reach_the_engine_params",
    "stop_token_ids": END + "test_sampling_fields_reach_the_engine_params",
    "ignore_eos": END + "test_sampling_fields_reach_the_engine_params",
    "min_tokens": END + "test_stop_string_before_min_tokens_stays_in_the_text",
    "logprobs": END + "test_logprobs_zero_gives_the_chosen_token_alone",
    "top_logprobs": END + "test_logprobs_zero_gives_the_chosen_token_alone",
    "return_token_ids": HTTP + "test_n_seed_stop_and_token_ids",
    "return_tokens_as_token_ids": END + "test_logprob_tokens_as_ids",
    "truncate_prompt_tokens": END + "test_add_special_tokens_and_truncate_prompt_tokens",
    "add_special_tokens": END + "test_add_special_tokens_and_truncate_prompt_tokens",
    "tools": TOOLS + "test_tool_calls_and_reasoning_split_non_streamed",
    "tool_choice": TOOLS + "test_tool_choice_required_is_enforced",
    "parallel_tool_calls": TOOLS + "test_parallel_tool_calls_false_keeps_the_first",
    "include_reasoning": TOOLS + "test_tool_choice_none_leaves_the_text_alone",
    "add_generation_prompt": TOOLS + "test_continue_final_message_continues_it",
    "continue_final_message": TOOLS + "test_continue_final_message_continues_it",
    "chat_template": TOOLS + "test_per_request_chat_template_needs_the_server_to_trust_it",
    "chat_template_kwargs": TOOLS + "test_chat_template_kwargs_turn_thinking_off",
    "documents": TOOLS + "test_documents_and_reasoning_effort_reach_a_template_that_reads_them",
    "reasoning_effort": TOOLS + "test_documents_and_reasoning_effort_reach_a_template_that_reads_them",
    # the sampling fields (cluster/api/sampling_fields.py)
    "echo": SAMPLING + "test_echo_logprobs_equal_transformers",
    "prompt_logprobs": SAMPLING + "test_vllm_prompt_logprobs_on_both_endpoints",
    "logit_bias": SAMPLING + "test_logit_bias_and_penalties_are_honoured",
    "presence_penalty": SAMPLING + "test_logit_bias_and_penalties_are_honoured",
    "frequency_penalty": SAMPLING + "test_logit_bias_and_penalties_are_honoured",
    "repetition_penalty": SAMPLING + "test_logit_bias_and_penalties_are_honoured",
    "min_p": SAMPLING + "test_min_p_and_bad_words_are_honoured",
    "bad_words": SAMPLING + "test_min_p_and_bad_words_are_honoured",
    "best_of": SAMPLING + "test_best_of_returns_the_most_likely_of_its_sequences",
    "include_stop_str_in_output": SAMPLING + "test_stop_string_kept_and_special_tokens_shown",
    "skip_special_tokens": SAMPLING + "test_stop_string_kept_and_special_tokens_shown",
    "response_format": SAMPLING + "test_every_structured_output_form",
    "structured_outputs": SAMPLING + "test_every_structured_output_form",
    "guided_json": SAMPLING + "test_every_structured_output_form",
    "guided_regex": SAMPLING + "test_every_structured_output_form",
    "guided_choice": SAMPLING + "test_every_structured_output_form",
    "guided_grammar": SAMPLING + "test_every_structured_output_form",
    # xgrammar / auto only
    "guided_decoding_backend": SAMPLING + "test_bad_values_are_400s_naming_the_field",
}
# carry no meaning for the output: accepted, not used
IGNORED = {
    "user": "an end-user id",
    "request_id": "our ids are our own",
    "metadata": "stored nowhere",
    "store": "nothing is stored",
    "service_tier": "one tier",
    "prompt_cache_key": "routing hint",
    "safety_identifier": "an end-user id",
}
# refused by the schema itself (only the neutral value validates)
SCHEMA_REFUSED: dict[str, Any] = {}
# a value that asks for something, per refused field
SAMPLES: dict[str, Any] = {
    "structural_tag": "{}",
    "guided_whitespace_pattern": " ",
    "spaces_between_special_tokens": False,
    "allowed_token_ids": [1],
    "use_beam_search": True,
    "length_penalty": 0.5,
    "logits_processors": ["m.P"],
    "prompt_embeds": "AAAA",
    "cache_salt": "salt",
    "kv_transfer_params": {"a": 1},
    "vllm_xargs": {"a": 1},
    "priority": 1,
    "mm_processor_kwargs": {"a": 1},
    "suffix": "tail",
    "echo": True,
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "audio": {"voice": "x"},
    "modalities": ["text", "audio"],
    "prediction": {"a": 1},
    "web_search_options": {},
    "verbosity": "low",
}
BASE = {"completion": {"prompt": "hi"}, "chat": {"messages": [{"role": "user", "content": "hi"}]}}
VALIDATE = {"completion": validate_completion, "chat": validate_chat}
TABLES = {"completion": {**COMMON, **COMPLETION}, "chat": {**COMMON, **CHAT}}
SCHEMAS = {"completion": CompletionRequest, "chat": ChatCompletionRequest}
LISTS = {"completion": VLLM_COMPLETION, "chat": VLLM_CHAT}


def classify(kind: str, name: str) -> str:
    if name in TABLES[kind] or name in SCHEMA_REFUSED:
        return "refused"
    if name in HONOURED:
        return "honoured"
    return "ignored" if name in IGNORED else "unclassified"


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_every_field_is_classified(kind):
    ours = set(SCHEMAS[kind].model_fields)
    unknown = sorted(n for n in ours | set(LISTS[kind]) if classify(kind, n) == "unclassified")
    assert unknown == [], f"classify these {kind} fields (honoured with a test, refused or ignored)"
    refused_by_table_but_modelled = sorted(ours & set(TABLES[kind]))
    assert refused_by_table_but_modelled == [], "a field that is built leaves the unsupported table"


@pytest.mark.parametrize("name", sorted(HONOURED))
def test_honoured_fields_name_a_test_that_exists(name):
    path, func = HONOURED[name].split("::")
    module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    assert callable(getattr(module, func, None)), HONOURED[name]


@pytest.mark.parametrize(
    "kind,name", [(k, n) for k in ("completion", "chat") for n in LISTS[k] if n in TABLES[k] or n in SCHEMA_REFUSED]
)
def test_refused_fields_are_a_400_naming_them(kind, name):
    value = SCHEMA_REFUSED.get(name, SAMPLES.get(name))
    with pytest.raises(OpenAIError) as err:
        VALIDATE[kind]({**BASE[kind], name: value})
    assert err.value.status == 400 and err.value.param == name, err.value.message
    for neutral in TABLES[kind][name].neutral if name in TABLES[kind] else ():
        VALIDATE[kind]({**BASE[kind], name: neutral})  # asking for nothing is served


@pytest.mark.parametrize("kind,name", [(k, n) for k in ("completion", "chat") for n in LISTS[k] if n in IGNORED])
def test_ignored_fields_are_accepted(kind, name):
    VALIDATE[kind]({**BASE[kind], name: "x"})
