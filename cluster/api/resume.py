"""Resuming a replica stream elsewhere: what the ingress keeps per choice, and the request
that continues it (pure bookkeeping: no Ray, no asyncio; ``resumable.py`` drives it).

When the replica serving a ``GenerateRequest`` fails mid-stream, every unfinished choice
is re-issued to another replica with the tokens the client already has as its
``output_prefixes``: the new replica's engine counts them as the choice's first outputs
(``max_tokens``, ``min_tokens``, penalties, bad words, the grammar, seeded draws by
position) and its detokenizer replays them, so it sends exactly what the first replica
would have sent next -- a character split over the boundary, text held back as a
possible stop string and a stop string across the boundary included; stop strings are
matched on the replica, as for any choice. The client sees one stream. Invariants, per
choice, whatever the number of resumes:

- the tokens sent to the client are exactly ``ChoiceProgress.token_ids``, each once;
- ``prompt_logprobs`` and ``cached_tokens`` are the first replica's (the user's prompt);
  ``cumulative_logprob`` adds the resumed part to what was sent.

A choice that has sent no token is re-issued as it was (a retry).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from cluster.serving.messages import GenerateChunk, GenerateRequest


@dataclass
class ChoiceProgress:
    """What the client has received of one choice."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    started: bool = False  # a chunk arrived: prompt logprobs and cached tokens came with it
    cached_tokens: int = 0
    cumulative_logprob: float | None = None
    finished: bool = False
    base_logprob: float | None = None  # cumulative logprob sent before the current stream


@dataclass(frozen=True)
class ResumePlan:
    request: GenerateRequest
    kind: str  # "migration" (some choice had sent tokens) or "retry" (none had)


class StreamBook:
    """The progress of every choice of one ``GenerateRequest`` across its replica streams.

    ``index_map[i]`` is the original choice of index ``i`` in the current stream."""

    def __init__(self, request: GenerateRequest) -> None:
        self.request = request
        self.choices = [ChoiceProgress() for _ in request.params]
        self.index_map = list(range(request.num_choices))
        self.num_resumes = 0

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)

    def absorb(self, chunks: list[GenerateChunk]) -> list[GenerateChunk]:
        """The current stream's chunks, as the client's (original indices; chunks of a choice
        already finished here dropped)."""
        out = []
        for chunk in chunks:
            if not 0 <= chunk.index < len(self.index_map):
                raise RuntimeError(f"replica chunk for choice {chunk.index} of {len(self.index_map)}")
            j = self.index_map[chunk.index]
            progress = self.choices[j]
            if progress.finished:
                continue
            if self.num_resumes and progress.started:  # resumed: the first replica's prompt side, both logprob parts
                cumulative = chunk.cumulative_logprob
                if cumulative is not None and progress.base_logprob is not None:
                    cumulative += progress.base_logprob
                chunk = replace(chunk, cached_tokens=progress.cached_tokens, cumulative_logprob=cumulative)
            if chunk.index != j:
                chunk = replace(chunk, index=j)
            progress.token_ids.extend(chunk.new_token_ids)
            progress.text += chunk.delta_text
            if not progress.started:
                progress.started, progress.cached_tokens = True, chunk.cached_tokens
            progress.cumulative_logprob = chunk.cumulative_logprob
            progress.finished = chunk.finished
            out.append(chunk)
        return out

    def plan(self) -> ResumePlan:
        """The request continuing every unfinished choice; from now on the book maps the new
        stream's chunks."""
        todo = [j for j, c in enumerate(self.choices) if not c.finished]
        assert todo, "nothing to resume"
        for j in todo:
            self.choices[j].base_logprob = self.choices[j].cumulative_logprob
        params = [
            replace(self.request.params[j], prompt_logprobs=None) if self.choices[j].started else self.request.params[j]
            for j in todo
        ]
        prefixes = tuple(tuple(self.choices[j].token_ids) for j in todo)
        self.num_resumes += 1
        req = GenerateRequest(
            f"{self.request.request_id}-r{self.num_resumes}",
            self.request.prompt_token_ids,
            params,
            self.request.prompt,
            output_prefixes=prefixes if any(prefixes) else (),
        )
        self.index_map = todo
        return ResumePlan(req, "migration" if any(prefixes) else "retry")
