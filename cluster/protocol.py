"""OpenAI request schemas (completions and chat), validated with pydantic.

Unknown fields are ignored (clients send many); fields we accept are validated with the
OpenAI ranges, and sampling features we do not implement are rejected rather than
silently dropped.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    return_token_ids: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None

    @field_validator("max_tokens")
    @classmethod
    def _positive_max_tokens(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"max_tokens must be at least 1, got {v}")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, v: float) -> float:
        if v != 0.0:
            raise ValueError("presence/frequency penalties are not supported; use 0")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop must be up to 4 non-empty strings")
        return stops


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    max_tokens: int | None = 16

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) == 0:
            raise ValueError("prompt must not be empty")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt in the request (batched prompts expand)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_completion_tokens: int | None = None

    @model_validator(mode="after")
    def _merge_max_tokens(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None:
            if self.max_completion_tokens < 1:
                raise ValueError(f"max_completion_tokens must be at least 1, got {self.max_completion_tokens}")
            object.__setattr__(self, "max_tokens", self.max_completion_tokens)
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    def message_dicts(self) -> list[dict[str, Any]]:
        out = []
        for m in self.messages:
            content = m.content
            if isinstance(content, list):  # content parts: keep the text ones
                content = "".join(part.get("text", "") for part in content if part.get("type") == "text")
            out.append({"role": m.role, "content": content or ""})
        return out
