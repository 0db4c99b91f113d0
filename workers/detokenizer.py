"""Incremental detokenization and stop-string matching, per request.

Byte-level BPE can split one character over several tokens, so text is only released
once decoding no longer ends in the replacement character. For streaming, text that
could still be the start of a stop string is held back until it is decided.
"""

from __future__ import annotations

from typing import Protocol


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Decoder,
        stop: tuple[str, ...] = (),
        include_stop_str: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tok = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.stop = stop
        self.include_stop_str = include_stop_str
        self.text = ""
        self.matched_stop: str | None = None
        self._streamed = 0
        self._hold = max((len(s) for s in stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, token_id: int, check_stop: bool = True) -> str | None:
        """Add one token; return the stop string if the text now contains one.

        ``check_stop`` False (the request has fewer than ``min_tokens`` outputs): the new
        text is not searched, so a stop string met then stays in the text (vLLM's rule):
        a stop string counts only if it ends in text added while stops are checked.
        """
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._add_text(full[len(prefix) :], check_stop)
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
        return self.matched_stop

    def _add_text(self, delta: str, check_stop: bool = True) -> None:
        if self.matched_stop is not None:
            return
        before = len(self.text)
        self.text += delta
        if not check_stop:
            return
        best: tuple[int, str] | None = None
        for s in self.stop:  # a match must end in the new text
            idx = self.text.find(s, max(0, before - len(s) + 1))
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is not None:
            idx, s = best
            self.text = self.text[: idx + len(s)] if self.include_stop_str else self.text[:idx]
            self.matched_stop = s

    def flush(self) -> None:
        """At finish: release any bytes still held for an incomplete character."""
        if self.matched_stop is not None or self._read_offset == len(self._ids):
            return
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix):
            self._add_text(full[len(prefix) :])
        self._read_offset = len(self._ids)

    def stream_delta(self, finished: bool) -> str:
        """New text safe to send now (all of it when finished)."""
        limit = len(self.text) if finished or self.matched_stop else max(len(self.text) - self._hold, 0)
        if limit <= self._streamed:
            return ""
        delta = self.text[self._streamed : limit]
        self._streamed = limit
        return delta
