"""The tokenizer endpoints' bodies (vLLM's shapes): ``/tokenize``, ``/detokenize``,
``/tokenizer_info``; and ``/version``.

``/tokenize`` with ``messages`` renders them exactly as a chat request would (the same
``chat_prompt.render_chat``: template, tools, generation prompt, kwargs), so a client can
count a chat prompt's tokens before sending it.
"""

from __future__ import annotations

import json
from importlib import metadata
from typing import Any

from cluster.api.chat_prompt import ChatSetup, render_chat
from cluster.api.errors import OpenAIError
from cluster.api.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest


def tokenize_body(
    req: TokenizeCompletionRequest | TokenizeChatRequest, tokenizer: Any, setup: ChatSetup, max_model_len: int
) -> dict[str, Any]:
    if isinstance(req, TokenizeChatRequest):
        ids = render_chat(req, tokenizer, setup).prompt_ids
    else:
        ids = list(tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
    return {
        "count": len(ids),
        "max_model_len": max_model_len,
        "tokens": ids,
        "token_strs": tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None,
    }


def detokenize_body(req: DetokenizeRequest, tokenizer: Any, vocab_size: int) -> dict[str, Any]:
    bad = [t for t in req.tokens if t >= vocab_size]
    if bad:
        raise OpenAIError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})", param="tokens")
    return {"prompt": tokenizer.decode(req.tokens)}


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return str(value)


def tokenizer_info_body(tokenizer: Any, setup: ChatSetup) -> dict[str, Any]:
    """The tokenizer's configuration, as ``tokenizer_config.json`` holds it (vLLM's
    ``/tokenizer_info``): class, special tokens, lengths, the chat template in use."""
    init = {
        k: _jsonable(v)
        for k, v in getattr(tokenizer, "init_kwargs", {}).items()
        if k not in ("added_tokens_decoder", "name_or_path", "tokenizer_file", "vocab_file", "merges_file")
    }
    return {
        **init,
        "tokenizer_class": type(tokenizer).__name__,
        "chat_template": setup.chat_template,
        "vocab_size": len(tokenizer),
        "eos_token": tokenizer.eos_token,
        "bos_token": tokenizer.bos_token,
        "pad_token": tokenizer.pad_token,
        "tool_call_parser": setup.tool_parser,
        "reasoning_parser": setup.reasoning_parser,
    }


def version_body() -> dict[str, str]:
    try:
        version = metadata.version("hybridserve")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return {"version": version}
