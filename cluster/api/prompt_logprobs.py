"""Rendering prompt logprobs (``echo`` with ``logprobs``, vLLM's ``prompt_logprobs``) and
keeping the best ``n`` of ``best_of`` sequences.

The engine scores each prompt token from the model's raw logits during prefill
(``RequestOutput.prompt_logprobs``: entry 0 is None, nothing scores the first token).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from workers.outputs import RequestOutput
from workers.request import TokenLogprob


def _text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def top_entries(lp: TokenLogprob, k: int, tokenizer) -> dict[str, float]:
    """The legacy completions ``top_logprobs`` dict: the scored token, then the top k."""
    out = {_text(tokenizer, lp.token_id): lp.logprob}
    for token_id, value in lp.top[:k]:
        out.setdefault(_text(tokenizer, token_id), value)
    return out


def echo_logprobs(prompt_ids: list[int], entries: list[TokenLogprob | None], k: int, tokenizer) -> dict[str, list[Any]]:
    """The prompt's part of a completions ``logprobs`` object (``echo``): one entry per
    prompt token, the first with null logprobs, offsets from 0."""
    tokens = [_text(tokenizer, t) for t in prompt_ids]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [None if e is None else e.logprob for e in entries],
        "top_logprobs": [None if e is None else top_entries(e, k, tokenizer) for e in entries],
        "text_offset": offsets,
    }


def vllm_prompt_logprobs(entries: list[TokenLogprob | None], k: int, tokenizer) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: per position null or {token id: {logprob, rank, decoded_token}}
    holding the prompt token and the top k."""
    out: list[dict[str, Any] | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        ranked = {e.token_id: (e.logprob, e.rank)}
        for i, (token_id, value) in enumerate(e.top[:k]):
            ranked.setdefault(token_id, (value, i + 1))
        out.append(
            {str(t): {"logprob": v, "rank": r, "decoded_token": _text(tokenizer, t)} for t, (v, r) in ranked.items()}
        )
    return out


def keep_best(outputs: list[RequestOutput], run: int, keep: int) -> list[RequestOutput]:
    """Per prompt (``run`` sequences each, in order), the ``keep`` with the highest
    cumulative logprob, best first."""
    if run == keep:
        return outputs
    best: list[RequestOutput] = []
    for start in range(0, len(outputs), run):
        group = outputs[start : start + run]
        ranked = sorted(
            group,
            key=lambda o: o.cumulative_logprob if o.cumulative_logprob is not None else float("-inf"),
            reverse=True,
        )
        best.extend(ranked[:keep])
    return [replace(o, request_id=str(i)) for i, o in enumerate(best)]
