"""Structured outputs with xgrammar: compiled grammars, per-request matchers, bitmasks.

- ``GrammarCompiler`` compiles a ``StructuredOutput`` against the tokenizer once and
  caches it by the constraint (an LRU of ``max_cached`` entries), on its own thread: the
  engine submits at ``add_request`` and admits the request when the grammar is ready,
  so a slow schema never stalls a step.
- ``GrammarBank`` holds one matcher per request and is touched only by the forward
  thread: masks are filled there from the matcher's state after the last processed
  sample, and every sampled token is accepted there right after sampling. Batch N+1 runs
  after batch N on that thread, so it sees N's token although the host has not yet
  processed it (the overlap lag), just as with no lag. For a verify, the matcher is
  advanced through the drafts to fill each row's mask (row i: after d_1..d_i) and rolled
  back; the accepted tokens are then accepted for real. Drops arrive with a launched
  step (``SamplingInputs.grammar_drops``), after every step that could still use them.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from workers.sampling.inputs import GrammarRows
from workers.sampling.structured import StructuredOutput, build_grammar

logger = logging.getLogger(__name__)
FULL = -1  # int32 with every bit set: every token allowed


class GrammarCompiler:
    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int, max_cached: int = 256) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.max_cached = max_cached
        self._lock = threading.Lock()  # the cache (the engine thread takes it: short)
        self._init_lock = threading.Lock()  # building xgrammar's compiler (compile thread)
        self._cache: OrderedDict[StructuredOutput, Future] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self._xgr_compiler: Any = None

    def _compiler(self) -> Any:
        with self._init_lock:
            if self._xgr_compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(self._load_tokenizer(), vocab_size=self.vocab_size)
                self._xgr_compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._xgr_compiler

    def _compile(self, so: StructuredOutput) -> Any:
        return self._compiler().compile_grammar(build_grammar(so))

    def submit(self, so: StructuredOutput) -> Future:
        """The compiled grammar of ``so`` (a done future when cached)."""
        with self._lock:
            fut = self._cache.get(so)
            if fut is not None:
                self._cache.move_to_end(so)
                return fut
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="hybridserve-grammar")
            fut = self._pool.submit(self._compile, so)
            self._cache[so] = fut
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
            return fut

    def get(self, so: StructuredOutput) -> Any:
        return self.submit(so).result()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


class GrammarBank:
    """Matchers by request handle (forward thread only)."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._matchers: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self._matchers)

    def drop(self, handles: tuple[int, ...]) -> None:
        for handle in handles:
            self._matchers.pop(handle, None)

    def matcher(self, handle: int, so: StructuredOutput, replay: tuple[int, ...] = ()) -> Any:
        """The request's matcher; a new one first accepts ``replay`` (outputs given at add)."""
        m = self._matchers.get(handle)
        if m is None:
            import xgrammar as xgr

            m = xgr.GrammarMatcher(self.compiler.get(so))
            self._matchers[handle] = m
            for t in replay:
                if m.is_terminated() or not m.accept_token(t):
                    logger.warning("request handle %d: its grammar refuses resumed output token %d", handle, t)
                    break
        return m

    def bitmask(
        self, groups: tuple[GrammarRows, ...], widths: tuple[int, ...], drafts: list[list[int]]
    ) -> torch.Tensor:
        """int32 [R, ceil(V / 32)] (CPU): each grammar row's allowed tokens, all bits
        elsewhere. ``drafts[g]``: the draft tokens of group g (empty unless a verify)."""
        import xgrammar as xgr

        mask = xgr.allocate_token_bitmask(sum(widths), self.compiler.vocab_size)
        for g, ds in zip(groups, drafts):
            m = self.matcher(g.handle, g.constraint, g.replay)
            if m.is_terminated():  # only after an ignored EOS: unconstrained
                continue
            m.fill_next_token_bitmask(mask, g.first_row)
            advanced = 0
            for i, d in enumerate(ds):
                if not m.accept_token(d):
                    break  # row i bans d: rows after it are never used
                advanced += 1
                if m.is_terminated():
                    break
                m.fill_next_token_bitmask(mask, g.first_row + i + 1)
            if advanced:
                m.rollback(advanced)
        return mask

    def accept(self, groups: tuple[GrammarRows, ...], tokens: list[list[int]]) -> None:
        """Advance each matcher by its sequence's sampled (accepted) tokens."""
        for g in groups:
            m = self.matcher(g.handle, g.constraint, g.replay)
            for t in tokens[g.seq]:
                if m.is_terminated() or not m.accept_token(t):
                    break


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor) -> None:
    """logits[r, v] = -inf where bit v of row r is 0 (rows with a full mask unchanged)."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (mask.to(logits.device)[:, :, None] >> shifts) & 1  # [R, W, 32]
    allowed = bits.reshape(mask.shape[0], -1)[:, :vocab].bool()
    logits.masked_fill_(~allowed, float("-inf"))


class GrammarWaitlist:
    """Requests whose grammar is still compiling; the engine admits them once it is ready
    (a request never reaches the scheduler before its grammar exists)."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._waiting: list[tuple[Any, Future]] = []

    def __len__(self) -> int:
        return len(self._waiting)

    def hold(self, req: Any) -> bool:
        """True when ``req`` waits here; False when it may be scheduled now."""
        so = req.params.structured_output
        if so is None:
            return False
        fut = self.compiler.submit(so)
        if fut.done() and fut.exception() is None:
            return False
        self._waiting.append((req, fut))
        return True

    def take_ready(self) -> tuple[list[Any], list[tuple[Any, BaseException]]]:
        """(requests now ready, (request, error) for grammars that failed to compile)."""
        ready, failed, keep = [], [], []
        for req, fut in self._waiting:
            if getattr(req, "is_finished", False):
                continue  # aborted while waiting
            if not fut.done():
                keep.append((req, fut))
            elif fut.exception() is not None:
                failed.append((req, fut.exception()))
            else:
                ready.append(req)
        self._waiting = keep
        return ready, failed
