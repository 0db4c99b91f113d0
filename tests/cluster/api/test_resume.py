"""Resume bookkeeping (``cluster/api/resume.py``), pure: a byte tokenizer, the replica's own
``OutputProcessor`` producing the chunks (the resumed replica's given the tokens sent as its
output prefix), a failure after every possible token count.

Whatever the point of failure, the client's tokens, text, finish reason and stop reason
equal the undisturbed run's -- a character split over the boundary, text held back as a
possible stop string and a stop string across the boundary included.
"""

from __future__ import annotations

import pytest

from cluster.api.resume import StreamBook
from cluster.serving.messages import GenerateRequest
from cluster.serving.replica_core import _chunk
from workers.output_processor import OutputProcessor
from workers.outputs import EngineOutput
from workers.request import TokenLogprob
from workers.sampling.params import SamplingParams

# "a", half of "é", its other half, "b", then "S", "T", "O", "P", "c", "d"
BYTES = {1: b"a", 3: b"\xc3", 4: b"\xa9", 2: b"b", 5: b"S", 6: b"T", 7: b"O", 8: b"P", 9: b"c", 10: b"d"}
ANSWER = [1, 3, 4, 2, 5, 6, 7, 9, 5, 6, 7, 8, 10, 1]  # "aébSTOcSTOPda": a near miss, then STOP
PROMPT = [2, 2]


class ByteTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return b"".join(BYTES[i] for i in ids).decode("utf-8", errors="replace")


def replica_chunks(
    params: SamplingParams,
    tokens: list[int],
    rid: str = "r",
    index: int = 0,
    lp: float = -0.5,
    per_step: int = 1,
    prefix: list[int] = (),
):
    """What a replica streams for an engine producing ``tokens`` (``per_step`` a step, as a
    verify accepting drafts does) under ``params``, after the output ``prefix`` it was given."""
    proc = OutputProcessor(ByteTokenizer())
    proc.add(rid, PROMPT, params, prefix)
    out = []
    tokens = tokens[: params.max_tokens - len(prefix)]
    for n in range(0, len(tokens), per_step):
        step = tokens[n : n + per_step]
        done = len(prefix) + n + len(step) == params.max_tokens
        lps = [TokenLogprob(t, lp, [(t, lp)]) for t in step] if params.needs_logprobs else None
        eo = EngineOutput(rid, step, lps, done, "length" if done else None, None, 3)
        delta = proc.process([eo]).deltas[0]
        out.append([_chunk(index, delta)])
        if delta.finished:
            break
    return out


def collect(book: StreamBook, stream: list) -> list:
    return [c for item in stream for c in book.absorb(item)]


def summary(chunks) -> tuple:
    last = chunks[-1]
    return (
        [t for c in chunks for t in c.new_token_ids],
        "".join(c.delta_text for c in chunks),
        last.finish_reason,
        last.stop_reason,
        last.finished,
    )


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=14, stop=("STOP",)),
        SamplingParams(max_tokens=9, stop=("STOP",), include_stop_str_in_output=True, logprobs=1),
        SamplingParams(max_tokens=14, stop=("STOP", "aé"), min_tokens=3),
    ],
)
def test_a_stream_resumed_after_any_token_equals_the_undisturbed_one(params):
    undisturbed = summary(collect(StreamBook(GenerateRequest("x", PROMPT, [params])), replica_chunks(params, ANSWER)))
    full = replica_chunks(params, ANSWER)
    for k in range(len(full)):  # fail after k chunks
        book = StreamBook(GenerateRequest("x", PROMPT, [params]))
        got = collect(book, full[:k])
        plan = book.plan()
        sent = book.choices[0].token_ids
        assert plan.kind == ("migration" if sent else "retry")
        assert plan.request.output_prefixes == ((tuple(sent),) if sent else ())
        resumed = plan.request.params[0]
        assert resumed.max_tokens == params.max_tokens and resumed.stop == params.stop
        got += collect(book, replica_chunks(resumed, ANSWER[len(sent) :], lp=-0.25, per_step=3, prefix=sent))
        assert summary(got) == undisturbed, k
        assert book.finished
        if params.logprobs is not None:
            assert len([lp for c in got for lp in c.logprobs]) == len(undisturbed[0])


def test_choices_are_mapped_back_and_finished_ones_are_not_resumed():
    p = SamplingParams(max_tokens=6, logprobs=0, prompt_logprobs=1)
    book = StreamBook(GenerateRequest("x", PROMPT, [p, p, p]))
    streams = [replica_chunks(p, ANSWER[j:], index=j) for j in range(3)]
    book.absorb(streams[0][0] + streams[1][0])  # choice 0 and 1: one token each
    book.absorb([c for item in streams[2] for c in item])  # choice 2 complete
    assert book.choices[2].finished
    plan = book.plan()
    assert book.index_map == [0, 1] and plan.request.request_id == "x-r1"
    assert plan.request.output_prefixes == ((ANSWER[0],), (ANSWER[1],))
    assert all(q.prompt_logprobs is None for q in plan.request.params)  # they came with the first chunk
    rest = replica_chunks(plan.request.params[1], ANSWER[2:], index=1, prefix=[ANSWER[1]])
    out = book.absorb(rest[0])
    assert [c.index for c in out] == [1] and out[0].cached_tokens == 3
    assert out[0].cumulative_logprob == pytest.approx(-1.0)  # the first replica's -0.5 + this one's -0.5


def test_bad_chunks_are_errors():
    book = StreamBook(GenerateRequest("x", PROMPT, [SamplingParams()]))
    with pytest.raises(RuntimeError, match="choice 1 of 1"):
        book.absorb(replica_chunks(SamplingParams(), ANSWER, index=1)[0])
    with pytest.raises(ValueError, match="output_prefixes"):
        GenerateRequest("x", PROMPT, [SamplingParams()], output_prefixes=((1,), (2,)))
