"""Logprobs objects of the OpenAI responses (completions' legacy shape and chat's).

Token strings are decoded the way the text is (special tokens skipped), so completions'
``text_offset`` follows the returned text; ``return_tokens_as_token_ids`` writes them as
``token_id:N`` instead. ``-inf`` becomes -9999.0 (JSON has no infinity; OpenAI's value).

Completions' ``top_logprobs`` holds the chosen token and the ``logprobs`` best ones (so
``logprobs: 0`` gives the chosen token alone), as vLLM and OpenAI's legacy API define it;
chat's ``top_logprobs`` list holds the ``top_logprobs`` best only (empty for 0).
"""

from __future__ import annotations

import math
from typing import Any

from workers.request import TokenLogprob

MIN_LOGPROB = -9999.0


def _value(v: float) -> float:
    return MIN_LOGPROB if math.isinf(v) or v < MIN_LOGPROB else v


def token_text(tokenizer: Any, token_id: int, as_id: bool = False) -> str:
    return f"token_id:{token_id}" if as_id else tokenizer.decode([token_id], skip_special_tokens=True)


def completion_logprobs(
    lps: list[TokenLogprob], tokenizer: Any, text_offset: int = 0, as_ids: bool = False
) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object; ``text_offset`` starts the offsets."""
    return completion_logprobs_from(lps, tokenizer, text_offset, as_ids)[0]


def completion_logprobs_from(
    lps: list[TokenLogprob], tokenizer: Any, text_offset: int, as_ids: bool = False
) -> tuple[dict[str, Any], int]:
    """``completion_logprobs`` and the offset after its last token, where the next stream
    chunk's offsets start: each token's offset is the length of the tokens' texts before
    it, as in the whole response, whatever the chunk boundaries (the streamed text itself
    can lag its tokens: the detokenizer holds back an incomplete character)."""
    texts = [token_text(tokenizer, lp.token_id) for lp in lps]
    tokens = [f"token_id:{lp.token_id}" for lp in lps] if as_ids else texts
    offsets, pos = [], text_offset
    for t in texts:
        offsets.append(pos)
        pos += len(t)
    tops = []
    for tok, lp in zip(tokens, lps):
        top = {tok: _value(lp.logprob)}
        for tid, v in lp.top:
            top.setdefault(token_text(tokenizer, tid, as_ids), _value(v))
        tops.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": [_value(lp.logprob) for lp in lps],
        "top_logprobs": tops,
        "text_offset": offsets,
    }, pos


def chat_logprobs(lps: list[TokenLogprob], tokenizer: Any, as_ids: bool = False) -> dict[str, Any]:
    def entry(tid: int, value: float) -> dict[str, Any]:
        tok = token_text(tokenizer, tid, as_ids)
        return {"token": tok, "logprob": _value(value), "bytes": list(tok.encode("utf-8"))}

    return {
        "content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]
    }
