"""OpenAI request schemas (completions and chat), validated with pydantic.

Unknown fields are ignored (clients send many); fields we accept are validated with the
OpenAI ranges, and sampling features we do not implement are rejected rather than
silently dropped. The constraints live in the field types where JSON schema can say
them, so ``/openapi.json`` (``cluster/api/openapi_schema.py``) describes what is accepted;
what depends on the model (context length, vocabulary) is checked in ``openai_service``.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cluster.api.sampling_fields import SamplingExtras

MAX_STOPS = 4
StopString = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(SamplingExtras):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOPS)] | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)     # int64, as torch seeds
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    return_token_ids: bool = False
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str]:
        return [v] if isinstance(v, str) else list(v or [])


class CompletionRequest(_SamplingFields):
    prompt: (str | Annotated[list[TokenId], Field(min_length=1)] | Annotated[list[str], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)])
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False                              # the prompt (and its logprobs) before the completion
    max_tokens: int | None = Field(16, ge=0)        # 0: nothing generated (echo, prompt_logprobs)

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt in the request (batched prompts expand)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ContentPart(BaseModel):
    """One part of a message's content list; only ``text`` parts reach the model."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_completion_tokens: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _merge_max_tokens(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None:
            object.__setattr__(self, "max_tokens", self.max_completion_tokens)
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    def message_dicts(self) -> list[dict[str, Any]]:
        out = []
        for m in self.messages:
            content = m.content
            if isinstance(content, list):  # content parts: keep the text ones
                content = "".join(part.text or "" for part in content if part.type == "text")
            out.append({"role": m.role, "content": content or ""})
        return out
