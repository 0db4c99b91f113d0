"""Request parameters we do not honour (yet): a 400 naming the parameter, never a silent drop.

Every entry is a vLLM or OpenAI request field that would change the output. A request
may send the field's *neutral* value (what asks for nothing: ``null``, ``1.0`` for a
repetition penalty, an empty ``logit_bias``...) and is served; any other value is refused
before validation by ``refuse_unsupported`` with ``param`` set to the field. The same
table feeds ``/openapi.json`` (the field is described with its neutral values only) and
``tests/cluster/api/test_field_coverage.py`` (which walks vLLM's fields).

When a feature lands, its field leaves this table and becomes a field of ``protocol``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cluster.api.errors import OpenAIError

NOT_YET = "is not implemented yet"
NOT_SERVED = "is not supported by this server"


@dataclass(frozen=True)
class Unsupported:
    neutral: tuple[Any, ...]  # values that ask for nothing (accepted)
    reason: str


def _u(*neutral: Any, reason: str = NOT_YET) -> Unsupported:
    return Unsupported((None, *neutral), reason)


# both endpoints
COMMON: dict[str, Unsupported] = {
    "structural_tag": _u(reason="is vLLM's old field; use response_format type structural_tag"),
    "guided_whitespace_pattern": _u(reason="is not supported by the xgrammar backend"),
    "spaces_between_special_tokens": _u(True),
    "allowed_token_ids": _u(),
    "use_beam_search": _u(False, reason=NOT_SERVED),
    "length_penalty": _u(1.0, reason=NOT_SERVED),
    "logits_processors": _u([], reason=NOT_SERVED),
    "prompt_embeds": _u(reason=NOT_SERVED),
    "cache_salt": _u(reason=NOT_SERVED),
    "kv_transfer_params": _u(reason=NOT_SERVED),
    "vllm_xargs": _u({}, reason=NOT_SERVED),
    "priority": _u(0, reason=NOT_SERVED),
    "mm_processor_kwargs": _u({}, reason=NOT_SERVED),
}
COMPLETION: dict[str, Unsupported] = {
    "suffix": _u("", reason=NOT_SERVED)  # no fill-in-the-middle template
}
CHAT: dict[str, Unsupported] = {
    "echo": _u(False),
    "functions": _u(reason="is deprecated; use tools"),
    "function_call": _u(reason="is deprecated; use tool_choice"),
    "audio": _u(reason=NOT_SERVED),
    "modalities": _u(["text"], reason=NOT_SERVED),
    "prediction": _u(reason=NOT_SERVED),
    "web_search_options": _u(reason=NOT_SERVED),
    "verbosity": _u(reason=NOT_SERVED),
}


def _same(value: Any, neutral: Any) -> bool:
    """Equal and of the same kind (``True`` is not the neutral ``1.0``)."""
    if isinstance(value, bool) != isinstance(neutral, bool):
        return False
    return value == neutral


def refuse_unsupported(body: Mapping[str, Any], table: Mapping[str, Unsupported]) -> None:
    """Raise a 400 naming the first field of ``table`` that ``body`` sets to a non-neutral value."""
    for name, entry in table.items():
        if name in body and not any(_same(body[name], n) for n in entry.neutral):
            shown = repr(body[name])
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise OpenAIError(
                f"{name}={shown} {entry.reason}; send it unset or null", param=name, code="unsupported_parameter"
            )


def schema_properties(table: Mapping[str, Unsupported]) -> dict[str, Any]:
    """JSON schema properties: each field accepts only its neutral values."""
    return {
        name: {"enum": list(entry.neutral), "description": f"{name} {entry.reason}: only the neutral value is accepted"}
        for name, entry in table.items()
    }
