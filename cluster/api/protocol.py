"""OpenAI request schemas (completions and chat), validated with pydantic.

Unknown fields are ignored (clients send many) unless ``unsupported`` lists them: a field
that would change the output and is not built is refused with a 400 naming it. Fields we
accept are validated with the OpenAI ranges. The constraints live in the field types
where JSON schema can say them, so ``/openapi.json`` (``cluster/api/openapi_schema.py``)
describes what is accepted; what depends on the model (context length, vocabulary, chat
template) is checked in ``openai_service`` / ``chat_prompt``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from cluster.api.errors import OpenAIError, from_validation_error
from cluster.api.sampling_fields import SamplingExtras
from cluster.api.unsupported import CHAT, COMMON, COMPLETION, refuse_unsupported
from workers.sampling.params import SEED_RANGE

MAX_STOPS = 4
StopString = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0)]
FUNCTION_NAME = r"^[a-zA-Z0-9_.-]{1,64}$"


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage on every chunk (with include_usage)


class _SamplingFields(SamplingExtras):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)  # None: the rest of the context
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOPS)] | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])  # int64, as torch seeds
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:N"
    truncate_prompt_tokens: int | None = Field(None, ge=1)  # keep the last N prompt tokens
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str]:
        return [v] if isinstance(v, str) else list(v or [])


class CompletionRequest(_SamplingFields):
    prompt: (
        str
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[str], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    )
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False  # the prompt (and its logprobs) before the completion
    # None: the rest of the context; 0: echo / prompt_logprobs only
    max_tokens: int | None = Field(None, ge=0)
    add_special_tokens: bool = True

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt in the request (batched prompts expand)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ContentPart(BaseModel):
    """One part of a message's content list; only ``text`` parts are served
    (``chat_prompt`` refuses the others by type)."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    name: str = Field(pattern=FUNCTION_NAME)
    arguments: str  # JSON text, as the model produced it


class MessageToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: the call answered
    reasoning_content: str | None = None  # assistant turns of reasoning models


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolParam(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatPromptFields(BaseModel):
    """What renders a conversation into a prompt (chat completions and ``/tokenize``)."""

    model_config = ConfigDict(extra="ignore")

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolParam] | None = Field(None, max_length=128)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = Field(None, min_length=1, max_length=65536)
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None

    @field_validator("tools")
    @classmethod
    def _unique_tools(cls, v: list[ToolParam] | None) -> list[ToolParam] | None:
        names = [t.function.name for t in v or []]
        if len(set(names)) != len(names):
            raise ValueError(f"function names must be unique, got {names}")
        return v

    @field_validator("continue_final_message")
    @classmethod
    def _continue_or_generate(cls, v: bool, info: ValidationInfo) -> bool:
        if v and info.data.get("add_generation_prompt"):
            raise ValueError("cannot be true together with add_generation_prompt (set that to false)")
        return v


class ChatCompletionRequest(_SamplingFields, ChatPromptFields):
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_completion_tokens: int | None = Field(None, ge=1)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    include_reasoning: bool = True

    @model_validator(mode="after")
    def _max_completion_tokens(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None:
            object.__setattr__(self, "max_tokens", self.max_completion_tokens)
        return self

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("requires logprobs to be true")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _choice_needs_tools(cls, v: Any, info: ValidationInfo) -> Any:
        tools = info.data.get("tools")
        names = [t.function.name for t in tools or []]
        if v not in (None, "none") and tools is None:
            raise ValueError("requires tools")
        if isinstance(v, NamedToolChoice) and v.function.name not in names:
            raise ValueError(f"function {v.function.name!r} is not one of the tools {names}")
        return v

    @property
    def tool_mode(self) -> str:
        """``none`` | ``auto`` | ``required`` | ``named`` (OpenAI's default: auto with tools)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        if not self.tools:  # required with no tools behaves as none
            return "none"
        return self.tool_choice or "auto"


class TokenizeCompletionRequest(BaseModel):
    """``POST /tokenize`` with a prompt (vLLM's shape)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatPromptFields):
    """``POST /tokenize`` with messages: the prompt a chat request would get."""

    model: str | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[TokenId]


def check_unicode(body: Any) -> None:
    """A 400 for a body holding a lone UTF-16 surrogate (valid JSON: ``"\\udcff"``, but no
    text: the tokenizer could not take it), naming the field (escaped, so the error object
    itself stays encodable)."""
    bad = _lone_surrogate(body, "")
    if bad is not None:
        param = bad.encode("utf-8", "backslashreplace").decode() or None
        raise OpenAIError(
            "request body holds a lone UTF-16 surrogate (an escape like \\udcff that encodes no character)",
            param=param,
            code="invalid_unicode",
        )


def _lone_surrogate(obj: Any, path: str) -> str | None:
    """The dotted path of the first string (key or value) that is not valid Unicode text."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        sub = f"{path}.{key}" if path else str(key)
        found = _lone_surrogate(key, sub) if isinstance(key, str) else None
        found = found if found is not None else _lone_surrogate(value, sub)
        if found is not None:
            return found
    return None


def validate_completion(body: dict[str, Any]) -> CompletionRequest:
    """A completions body as a request: unsupported fields first, then the schema (400s)."""
    refuse_unsupported(body, {**COMMON, **COMPLETION})
    return _validate(CompletionRequest, body)


def validate_chat(body: dict[str, Any]) -> ChatCompletionRequest:
    refuse_unsupported(body, {**COMMON, **CHAT})
    return _validate(ChatCompletionRequest, body)


def validate_tokenize(body: dict[str, Any]) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """``messages`` picks the chat form (vLLM's union), else the prompt form."""
    if "messages" in body:
        return _validate(TokenizeChatRequest, body)
    return _validate(TokenizeCompletionRequest, body)


def validate_detokenize(body: dict[str, Any]) -> DetokenizeRequest:
    return _validate(DetokenizeRequest, body)


def _validate(schema: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return schema.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
