"""Checks of a request's inputs that need the model (its vocabulary, its context length)."""

from __future__ import annotations

from workers.sampling.params import SamplingParams


def check_prompt(prompt: list[int], vocab_size: int, max_model_len: int) -> None:
    """Raise ValueError naming what is wrong with a prompt's token ids."""
    if not prompt:
        raise ValueError("prompt must contain at least one token")
    if len(prompt) >= max_model_len:
        raise ValueError(
            f"prompt has {len(prompt)} tokens; the maximum context length is "
            f"{max_model_len}, leaving no room to generate"
        )
    wrong = [t for t in prompt if type(t) is not int]
    if wrong:
        raise ValueError(f"prompt token ids must be ints, got {wrong[:5]!r}")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")


def check_params(params: SamplingParams, vocab_size: int) -> None:
    """Raise ValueError naming the first token id outside the vocabulary."""
    for name, ids in (
        ("logit_bias", [t for t, _ in params.logit_bias]),
        ("stop_token_ids", list(params.stop_token_ids)),
    ):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise ValueError(f"{name} token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")


def check_output_prefix(
    prompt_len: int, prefix: list[int], params: SamplingParams, vocab_size: int, max_model_len: int, eos: int | None
) -> None:
    """Raise ValueError unless ``prefix`` (output tokens generated elsewhere, replayed as this
    request's first outputs: a prefill/decode hand-off) leaves something to generate."""
    wrong = [t for t in prefix if type(t) is not int or not 0 <= t < vocab_size]
    if wrong:
        raise ValueError(f"output prefix token ids {wrong[:5]!r} are outside the vocabulary [0, {vocab_size})")
    ends = {*params.stop_token_ids, *(() if params.ignore_eos or eos is None else (eos,))}
    ended = [n for n, t in enumerate(prefix) if t in ends]
    if ended:
        n = ended[0]
        raise ValueError(f"output prefix token {n} ({prefix[n]}) is EOS or a stop token: that output ended")
    if len(prefix) >= params.max_tokens:
        raise ValueError(f"an output prefix of {len(prefix)} tokens leaves nothing of max_tokens={params.max_tokens}")
    if prompt_len + len(prefix) >= max_model_len:
        raise ValueError(
            f"prompt ({prompt_len}) + output prefix ({len(prefix)}) tokens reach the context length {max_model_len}"
        )
    if params.prompt_logprobs is not None:
        raise ValueError("prompt_logprobs cannot be asked of a request resumed after an output prefix")
