"""A conversation rendered into the prompt, and what the output will carry.

``render_chat`` applies the chat template (the model's, or the request's own when the
server trusts request templates) with the request's tools, documents, generation-prompt
settings and ``chat_template_kwargs``, and tokenizes the text. Message content parts are
text only: an image (or any other kind) is a 400 naming the part, never a silent drop.
Assistant tool calls reach the template with their arguments as JSON objects (Qwen's
templates iterate them), tool turns as ``role: tool`` with ``tool_call_id``.

``chat_output_spec`` decides how the output is read (``chat_output``): reasoning split
when the model has a reasoning parser, tool calls parsed for ``tool_choice: auto``.
``required`` and a named function are enforced by a JSON-schema constraint
(``tool_choice``, built in ``openai_service``), so their output is that JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from cluster.api.chat_output import ChatOutputSpec
from cluster.api.errors import OpenAIError
from cluster.api.protocol import ChatCompletionRequest, ChatMessage, ChatPromptFields
from cluster.api.reasoning import THINK_OPEN, prompt_opens_reasoning
from cluster.api.tool_parsers import parameter_types, pick_tool_parser

# apply_chat_template's own parameters: not for chat_template_kwargs to override
RESERVED_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "sanitize_control_tokens",
    }
)
IMAGE_PARTS = frozenset({"image_url", "image", "input_image"})


def template_text(tokenizer: Any) -> str | None:
    """The tokenizer's chat template source (several named ones joined)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template


def pick_reasoning_parser(setting: str, chat_template: str | None) -> str | None:
    if setting == "none":
        return None
    if setting != "auto":
        return setting
    return "qwen3" if chat_template and THINK_OPEN in chat_template else None


@dataclass(frozen=True)
class ChatSetup:
    """Per server: the model's template and the output parsers chosen for it."""

    chat_template: str | None
    tool_parser: str | None
    reasoning_parser: str | None
    trust_request_chat_template: bool = False
    unserved_vision: bool = False  # the checkpoint has a vision tower we do not run

    @classmethod
    def for_tokenizer(
        cls,
        tokenizer: Any,
        tool_call_parser: str = "auto",
        reasoning_parser: str = "auto",
        trust_request_chat_template: bool = False,
        model_dir: str | None = None,
    ) -> ChatSetup:
        template = template_text(tokenizer)
        return cls(
            template,
            pick_tool_parser(tool_call_parser, template),
            pick_reasoning_parser(reasoning_parser, template),
            trust_request_chat_template,
            _unserved_vision(model_dir),
        )


def _unserved_vision(model_dir: str | None) -> bool:
    """From config.json alone (``workers.loader.image_support``); False when unknown."""
    if model_dir is None:
        return False
    from workers.loader import image_support

    try:
        support = image_support(model_dir)
    except (OSError, ValueError):
        return False
    return support.vl_checkpoint and not support.serves_images


@dataclass(frozen=True)
class RenderedChat:
    text: str
    prompt_ids: list[int]


def _content_text(i: int, content: Any, setup: ChatSetup) -> str:
    if not isinstance(content, list):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.type == "text":
            texts.append(part.text or "")
        elif part.type in IMAGE_PARTS:
            why = (
                "this checkpoint's vision tower is not loaded, only its language model"
                if setup.unserved_vision
                else "this server takes text content parts only"
            )
            raise OpenAIError(
                f"images are not served yet: {why}", param=f"messages.{i}.content.{j}", code="unsupported_content"
            )
        else:
            raise OpenAIError(
                f"content parts of type {part.type!r} are not supported (only 'text')",
                param=f"messages.{i}.content.{j}.type",
                code="unsupported_content",
            )
    return "".join(texts)


def message_dict(i: int, m: ChatMessage, setup: ChatSetup) -> dict[str, Any]:
    """One message as the template sees it (extra fields the client sent are kept)."""
    out = m.model_dump(exclude_none=True, exclude={"content", "tool_calls"})
    out["content"] = _content_text(i, m.content, setup)
    if m.tool_calls:
        calls = []
        for j, call in enumerate(m.tool_calls):
            try:
                args = json.loads(call.function.arguments)
            except json.JSONDecodeError:
                raise OpenAIError(
                    "tool call arguments must be JSON text", param=f"messages.{i}.tool_calls.{j}.function.arguments"
                ) from None
            calls.append({**call.model_dump(), "function": {"name": call.function.name, "arguments": args}})
        out["tool_calls"] = calls
    return out


def _template(fields: ChatPromptFields, setup: ChatSetup) -> str | None:
    if fields.chat_template is None:
        return setup.chat_template
    if not setup.trust_request_chat_template:
        raise OpenAIError(
            "per-request chat templates are disabled on this server (config server.trust_request_chat_template)",
            param="chat_template",
            code="unsupported_parameter",
        )
    return fields.chat_template


def _template_kwargs(fields: ChatPromptFields, template: str | None) -> dict[str, Any]:
    kwargs = dict(fields.chat_template_kwargs or {})
    clash = sorted(RESERVED_KWARGS & kwargs.keys())
    if clash:
        raise OpenAIError(
            f"chat_template_kwargs may not set {clash}: use the request fields",
            param=f"chat_template_kwargs.{clash[0]}",
        )
    # honoured only by a template that reads them: refused rather than silently dropped
    for name in ("documents", "reasoning_effort"):
        value = getattr(fields, name)
        if value is not None:
            if name not in (template or ""):
                raise OpenAIError(
                    f"{name} is not used by this model's chat template", param=name, code="unsupported_parameter"
                )
            kwargs[name] = value
    return kwargs


def render_chat(fields: ChatPromptFields, tokenizer: Any, setup: ChatSetup) -> RenderedChat:
    messages = [message_dict(i, m, setup) for i, m in enumerate(fields.messages)]
    template = _template(fields, setup)
    kwargs = _template_kwargs(fields, template)
    tools = [t.model_dump(exclude_none=True) for t in fields.tools] if fields.tools else None
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            chat_template=template,
            add_generation_prompt=fields.add_generation_prompt,
            continue_final_message=fields.continue_final_message,
            tokenize=False,
            **kwargs,
        )
    except Exception as exc:  # noqa: BLE001 - template errors are the caller's input
        raise OpenAIError(f"could not apply the chat template: {exc}"[:500], param="messages") from None
    ids = list(tokenizer.encode(text, add_special_tokens=fields.add_special_tokens))
    return RenderedChat(text, ids)


def chat_output_spec(req: ChatCompletionRequest, rendered: RenderedChat, setup: ChatSetup) -> ChatOutputSpec:
    mode = req.tool_mode
    if mode in ("required", "named"):  # constrained JSON (tool_choice.forced_schema), no reasoning
        named = req.tool_choice.function.name if mode == "named" else None  # type: ignore[union-attr]
        return ChatOutputSpec(forced=True, forced_name=named, parallel_tool_calls=req.parallel_tool_calls)
    if mode == "auto" and setup.tool_parser is None:
        raise OpenAIError(
            "this model's chat template shows no tool-call format, so tool calls cannot be "
            "parsed (config server.tool_call_parser); send tool_choice none or no tools",
            param="tool_choice" if req.tool_choice else "tools",
            code="unsupported_parameter",
        )
    tools = [t.model_dump() for t in req.tools or []]
    return ChatOutputSpec(
        reasoning=setup.reasoning_parser is not None,
        starts_in_reasoning=setup.reasoning_parser is not None and prompt_opens_reasoning(rendered.text),
        include_reasoning=req.include_reasoning,
        tool_parser=setup.tool_parser if mode == "auto" else None,
        tool_params=parameter_types(tools),
        parallel_tool_calls=req.parallel_tool_calls,
    )
