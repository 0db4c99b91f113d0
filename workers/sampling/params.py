"""Per-request sampling settings, validated at the Python boundary."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from workers.sampling.structured import StructuredOutput

GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20
LOGIT_BIAS_LIMIT = 100.0
MAX_BEST_OF = 16  # sequences per prompt (OpenAI's and HTTP's n cap)
SEED_RANGE = (-(2**63), 2**63 - 1)  # int64: what torch generators and HTTP take


@dataclass(frozen=True)
class SamplingParams:
    """vLLM-shaped sampling parameters. Raises ValueError naming the offending value.

    - ``temperature`` below ``GREEDY_TEMPERATURE`` (vLLM's sampling epsilon) is greedy:
      dividing logits by a smaller one overflows to inf and then NaN probabilities.
      ``top_k <= 0`` (or -1) disables top-k; ``min_p`` keeps tokens whose probability is
      at least ``min_p`` times the top token's.
    - ``max_tokens = 0`` only prefills (for ``prompt_logprobs``): nothing is generated.
    - ``logprobs``: top alternatives per generated token (None = none; 0 = only the chosen
      token's logprob); ``prompt_logprobs`` the same per prompt token (the first is None).
      Log-probabilities are the model's, before any processing (vLLM's raw logprobs).
    - ``stop`` strings end generation and are cut from the text (kept with
      ``include_stop_str_in_output``); ``stop_token_ids`` end it too. Until
      ``min_tokens`` tokens exist, EOS and the stop tokens cannot be sampled and stop
      strings are not matched -- unless a ``structured_output`` grammar allows nothing
      else: the grammar wins, and its EOS ends the request.
    - Processors, in this order (transformers' order): ``logit_bias`` (token id -> added
      bias in [-100, 100]), ``bad_words`` (never complete one of these words),
      ``min_tokens``, ``repetition_penalty`` (> 0; divides positive and multiplies negative
      logits of every prompt or output token), ``frequency_penalty`` and
      ``presence_penalty`` (in [-2, 2]; subtract count * f and [count > 0] * p over the
      output tokens, OpenAI's definition), the ``structured_output`` grammar; then
      temperature, top-k, top-p, min-p.
    - ``best_of``: generate that many and keep the one with the highest cumulative
      logprob (the offline API; the HTTP layer keeps the best ``n``).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    bad_words: tuple[str, ...] = ()
    best_of: int | None = None
    structured_output: StructuredOutput | None = None
    extra: dict[str, object] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        object.__setattr__(self, "bad_words", tuple(self.bad_words or ()))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        self._validate()

    def _validate(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 0:
            raise ValueError(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")
        _check_range("temperature", self.temperature, 0.0, math.inf)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or >= 1, got {self.top_k!r}")
        _check_range("min_p", self.min_p, 0.0, 1.0)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if any(not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty, got {list(self.stop)!r}")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {list(self.stop_token_ids)!r}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise ValueError(f"bad_words must be non-blank strings, got {list(self.bad_words)!r}")
        if self.best_of is not None and not (_is_int(self.best_of) and 1 <= self.best_of <= MAX_BEST_OF):
            raise ValueError(f"best_of must be an integer in [1, {MAX_BEST_OF}], got {self.best_of!r}")
        if self.seed is not None and not (_is_int(self.seed) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise ValueError(f"seed must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {self.seed!r}")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise ValueError(
                f"structured_output must be a StructuredOutput, got {type(self.structured_output).__name__}"
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def effective_top_k(self) -> int:
        """0 means no top-k filtering."""
        return 0 if self.top_k in (-1, 0) else self.top_k

    @property
    def uses_penalties(self) -> bool:
        """Needs the per-request token-count registers (prompt presence, output counts)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def needs_logprobs(self) -> bool:
        """The chosen token's logprob is computed (asked for, or to rank best_of)."""
        return self.logprobs is not None or (self.best_of or 1) > 1


def nth_seed(seed: int | None, n: int) -> int | None:
    """The seed of the n-th sequence of a seeded prompt (``n`` / ``best_of``): ``seed + n``,
    wrapped into ``SEED_RANGE`` so that the largest seed still has n successors."""
    if seed is None:
        return None
    low, high = SEED_RANGE
    return (seed + n - low) % (high - low + 1) + low


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value!r}")


def _bias_pairs(bias: Mapping[int, float] | tuple | None) -> tuple[tuple[int, float], ...]:
    """``{token id: bias}`` as sorted pairs (hashable); ids >= 0, biases in [-100, 100]."""
    items = list(bias.items()) if isinstance(bias, Mapping) else list(bias or ())
    pairs: dict[int, float] = {}
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise ValueError(f"logit_bias must map token ids to numbers, got {item!r}")
        token, value = item
        if isinstance(token, str) and token.strip().lstrip("-").isdigit():
            token = int(token)  # JSON object keys arrive as strings
        if not _is_int(token) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids >= 0, got {token!r}")
        _check_range(f"logit_bias[{token}]", value, -LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT)
        pairs[token] = float(value)
    return tuple(sorted(pairs.items()))
