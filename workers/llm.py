"""The offline Python API, shaped like vLLM's ``LLM`` (DESIGN §4.4)."""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from configs.schema import HybridServeConfig, load_config
from workers.engine import Engine
from workers.output_processor import OutputProcessor
from workers.outputs import RequestOutput
from workers.sampling.params import SamplingParams, nth_seed
from workers.tp.local import build_local_engine

Prompt = str | list[int]


class LLM:
    """``LLM(model=DIR, cache={...}, scheduler={...}, ...)``: config fields as overrides.

    The engine (and, once enabled, its prefix cache) persists across ``generate`` calls.
    """

    def __init__(self, model: str | None = None, config: HybridServeConfig | None = None, **overrides: Any) -> None:
        if config is None:
            if model is not None:
                overrides["model"] = model
            config = load_config(overrides=overrides)
        elif model is not None or overrides:
            raise ValueError("pass either config= or model=/overrides, not both")
        self.config = config
        self.engine: Engine = build_local_engine(config)  # TP > 1: worker ranks as processes
        self.tokenizer = self.engine.tokenizer
        self.frontend = OutputProcessor(self.tokenizer)  # text, stop strings: off the engine
        self._ids = itertools.count()

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        wrong = [t for t in prompt if not isinstance(t, int) or isinstance(t, bool)]
        if wrong:
            raise ValueError(f"a token-id prompt must be a list of ints, got {wrong[:5]!r}")
        return list(prompt)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def generate(
        self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        A bad prompt raises ValueError before anything is queued.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        encoded = [self.encode(p) for p in prompts]
        outputs = self.generate_ids(encoded, plist)
        return [_with_prompt(o, p) for o, p in zip(outputs, prompts)]

    def generate_ids(
        self, encoded: list[list[int]], plist: list[SamplingParams], expand_best_of: bool = True
    ) -> list[RequestOutput]:
        """Token-id prompts, one SamplingParams each; all run together, in input order.

        ``best_of = b`` runs b sequences for the prompt (seeds ``seed + j`` when seeded)
        and returns the one with the highest cumulative logprob; ``expand_best_of=False``
        runs each params once (a caller that expanded best_of itself, reporting each
        sequence's ``cumulative_logprob``).
        """
        copies = [
            (i, ids, _copy_params(p, j))
            for i, (ids, p) in enumerate(zip(encoded, plist))
            for j in range((p.best_of or 1) if expand_best_of else 1)
        ]
        order: dict[str, int] = {}
        added: list[str] = []
        try:
            for n, (_, ids, p) in enumerate(copies):
                rid = f"offline-{next(self._ids)}"
                self.add_request(rid, ids, p)
                order[rid] = n
                added.append(rid)
            results = self._run(order)
        except BaseException:  # bad input, a failed step, an interrupt:
            for rid in added:  # nothing of this call stays queued
                self.engine.abort(rid)
                self.frontend.discard(rid)
            raise
        best: list[RequestOutput | None] = [None] * len(encoded)
        for (i, _, _), out in zip(copies, results):
            assert out is not None
            if best[i] is None or (out.cumulative_logprob or 0.0) > (best[i].cumulative_logprob or 0.0):
                best[i] = out
        return [b for b in best if b is not None]

    def _run(self, order: dict[str, int]) -> list[RequestOutput | None]:
        """Step until every request of ``order`` (id -> output index) has finished."""
        results: list[RequestOutput | None] = [None] * len(order)
        remaining = len(order)
        while remaining:
            for out in self.step():
                if out.request_id in order:
                    results[order[out.request_id]] = out
                    remaining -= 1
        while self.engine.has_unfinished():  # the overlap lag leaves one batch in flight
            self.engine.step()
        return results

    # -- step by step (vLLM's LLMEngine shape) -------------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, output_prefix: Sequence[int] = ()
    ) -> None:
        """Queue one request; ``step`` returns its output once it has finished.
        ``output_prefix``: its first outputs, generated elsewhere (``Engine.add_request``)."""
        self.engine.add_request(request_id, prompt_token_ids, params, output_prefix)
        try:
            self.frontend.add(request_id, list(prompt_token_ids), params, output_prefix)
        except ValueError:
            self.engine.abort(request_id)
            raise

    def step(self) -> list[RequestOutput]:
        """One engine step; the whole outputs of the requests that finished in it."""
        processed = self.frontend.process(self.engine.step())
        for rid in processed.stop:  # a stop string: the engine ends it too
            self.engine.stop(rid)
        return [self.frontend.final(d.request_id) for d in processed.deltas if d.finished]

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request now; its output so far (None if it was not running)."""
        out = self.engine.abort(request_id)
        if request_id not in self.frontend:
            return None
        if out is None:  # already ended in the engine (or unknown)
            self.frontend.discard(request_id)
            return None
        self.frontend.process([out])
        return self.frontend.final(request_id)

    def stats(self) -> dict[str, object]:
        return self.engine.stats.snapshot()

    def flush_cache(self) -> None:
        """Empty the prefix cache; later prompts start cold."""
        self.engine.flush_cache()

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (a no-op for TP = 1)."""
        close = getattr(self.engine, "shutdown", None)
        if callable(close):
            close()


def _copy_params(p: SamplingParams, j: int) -> SamplingParams:
    """The j-th of ``best_of`` sequences: its own seed when the request is seeded."""
    if j == 0 or p.seed is None:
        return p
    from dataclasses import replace

    return replace(p, seed=nth_seed(p.seed, j))


def _with_prompt(out: RequestOutput, prompt: Prompt) -> RequestOutput:
    from dataclasses import replace

    return replace(out, prompt=prompt if isinstance(prompt, str) else None)
