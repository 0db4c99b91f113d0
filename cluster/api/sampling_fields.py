"""The extra sampling and structured-output request fields, shared by completions and chat.

``SamplingExtras`` is a base of both request schemas: vLLM's extra sampling parameters
(``repetition_penalty``, ``min_p``, ``bad_words``, ``prompt_logprobs``,
``include_stop_str_in_output``, ``skip_special_tokens``, ``best_of``), OpenAI's
``logit_bias`` and penalties, and every way to ask for structured output: OpenAI's
``response_format`` (``json_object`` / ``json_schema``), vLLM's ``structured_outputs``
(json, regex, choice, grammar, json_object, structural_tag) and its older ``guided_*``
names. ``constraint`` turns them into the one ``StructuredOutput`` the engine honours (a
400 naming the field when two are given or a schema does not compile).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from workers.sampling.params import LOGIT_BIAS_LIMIT, MAX_BEST_OF, MAX_LOGPROBS
from workers.sampling.structured import StructuredOutput


class ConstraintError(ValueError):
    """A structured-output request that cannot be honoured; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = Field("response", max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``; vLLM's ``structural_tag`` form carries ``format``."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of the constraint fields."""

    model_config = ConfigDict(extra="ignore")

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None


_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
BadWord = Annotated[str, Field(min_length=1, max_length=256)]


class SamplingExtras(BaseModel):
    model_config = ConfigDict(extra="ignore")

    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    logit_bias: dict[str, float] | None = None
    bad_words: list[BadWord] | None = Field(None, max_length=64)
    best_of: int | None = Field(None, ge=1, le=MAX_BEST_OF)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None
    guided_decoding_backend: Literal["xgrammar", "auto"] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (v or {}).items():
            if not key.strip().isdigit():
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
                raise ValueError(f"bias of token {key} must be in [-100, 100], got {value}")
        return v

    def sampling_kwargs(self) -> dict[str, Any]:
        """SamplingParams keyword arguments for these fields (the constraint included)."""
        return dict(
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            min_p=self.min_p,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            bad_words=tuple(self.bad_words or ()),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            structured_output=self.constraint(),
        )

    def constraint(self) -> StructuredOutput | None:
        """The one structured-output constraint asked for (ConstraintError otherwise)."""
        found = [
            c
            for c in (self._from_response_format(), self._from_structured_outputs(), *self._from_guided())
            if c is not None
        ]
        if len(found) > 1:
            raise ConstraintError(
                f"only one structured-output constraint may be given; got {', '.join(p for p, _ in found)}", found[1][0]
            )
        return found[0][1] if found else None

    def _from_response_format(self) -> tuple[str, StructuredOutput] | None:
        rf = self.response_format
        if rf is None or rf.type == "text":
            return None
        if rf.type == "json_object":
            return "response_format", _build("response_format", StructuredOutput.json_object)
        if rf.type == "json_schema":
            js = rf.json_schema
            if js is None or js.json_schema is None:
                raise ConstraintError(
                    "response_format json_schema needs json_schema.schema", "response_format.json_schema"
                )
            # Always xgrammar's strict mode (as vLLM): an object without properties the
            # schema does not name is valid whether or not the client asked for strict.
            return "response_format", _build(
                "response_format.json_schema.schema", StructuredOutput.json_schema, js.json_schema
            )
        tag = {k: v for k, v in (rf.model_extra or {}).items()}
        return "response_format", _build(
            "response_format", StructuredOutput.structural_tag, {"type": "structural_tag", **tag}
        )

    def _from_structured_outputs(self) -> tuple[str, StructuredOutput] | None:
        so = self.structured_outputs
        if so is None:
            return None
        if so.whitespace_pattern is not None:
            raise ConstraintError(
                "whitespace_pattern is not supported by the xgrammar backend", "structured_outputs.whitespace_pattern"
            )
        ws = not so.disable_any_whitespace
        given = [
            (name, value)
            for name, value in (
                ("json", so.json_),
                ("regex", so.regex),
                ("choice", so.choice),
                ("grammar", so.grammar),
                ("structural_tag", so.structural_tag),
            )
            if value is not None
        ] + ([("json_object", True)] if so.json_object else [])
        if len(given) != 1:
            raise ConstraintError(
                f"structured_outputs needs exactly one of json, regex, choice, grammar, "
                f"json_object, structural_tag; got {[n for n, _ in given] or 'none'}",
                "structured_outputs",
            )
        name, value = given[0]
        return "structured_outputs", _constraint(f"structured_outputs.{name}", name, value, ws)

    def _from_guided(self) -> list[tuple[str, StructuredOutput]]:
        out = []
        for field in _GUIDED:
            value = getattr(self, field)
            if value is not None:
                out.append((field, _constraint(field, field.removeprefix("guided_"), value, True)))
        return out


def _constraint(param: str, kind: str, value: Any, any_whitespace: bool) -> StructuredOutput:
    if kind == "json":
        return _build(param, StructuredOutput.json_schema, value, any_whitespace=any_whitespace)
    if kind == "json_object":
        return _build(param, StructuredOutput.json_object, any_whitespace)
    if kind == "regex":
        return _build(param, StructuredOutput.regex, value)
    if kind == "choice":
        return _build(param, StructuredOutput.choice, value)
    if kind == "grammar":
        return _build(param, StructuredOutput.grammar, value)
    return _build(param, StructuredOutput.structural_tag, value)


def _build(param: str, make: Any, *args: Any, **kwargs: Any) -> StructuredOutput:
    try:
        return make(*args, **kwargs)
    except ValueError as exc:
        raise ConstraintError(str(exc), param) from None
