"""``bench correctness`` without servers: the workload's boundary lengths and sessions, the
token comparison, the near-tie rule and the JSON check."""

from __future__ import annotations

import pytest

from cluster.bench.correctness_compare import Reply, compare, is_malformed_json, is_near_tie, json_parses, parse_choice
from cluster.bench.correctness_workload import (
    Filler,
    Text,
    WorkloadSettings,
    boundary_lengths,
    build_workload,
    json_request,
)


def test_boundary_lengths_are_page_and_grid_points_plus_minus_one():
    assert boundary_lengths(16, 256) == [15, 16, 17, 31, 32, 33, 255, 256, 257, 271, 272, 273, 511, 512, 513]
    assert boundary_lengths(4, 16, max_len=17) == [3, 4, 5, 7, 8, 9, 15, 16, 17]
    assert boundary_lengths(1, 2) == [1, 2, 3, 4, 5]  # page 1: the points overlap, never 0


def test_system_prompts_sit_on_boundaries_and_span_them():
    s = WorkloadSettings(requests=300, seed=5, page_size=4, track_interval=16, num_system_prompts=8)
    w = build_workload(s)
    lengths = boundary_lengths(4, 16)
    systems = sorted(len(p) for p in w.system_prompts)
    assert set(systems) <= set(lengths) and systems[0] == lengths[0] and systems[-1] == lengths[-1]
    assert all(s.token_low <= t < s.token_high for p in w.system_prompts for t in p)


def test_sessions_have_every_kind_and_exactly_the_requests():
    s = WorkloadSettings(requests=301, seed=1, page_size=4, track_interval=16)
    w = build_workload(s)
    assert w.num_requests == 301
    assert {x.kind for x in w.sessions} == {"single", "repeat", "chat", "json"}
    for x in w.sessions:
        first, rest = x.steps[0], x.steps[1:]
        assert first.kind == "first" and all(st.kind != "first" for st in rest)
        if x.kind == "repeat" and rest:
            assert rest[0].kind == "repeat" and rest[0].pieces == ()
        if x.kind == "json":
            assert all(st.json_prefix is not None and isinstance(st.pieces[-1], Text) for st in x.steps)
            assert all(st.pieces[-1].text.endswith(st.json_prefix) for st in x.steps)
        if x.kind == "chat":
            assert all(st.kind == "follow_up" and isinstance(st.pieces[0], Filler) for st in rest)


def test_half_the_first_turns_end_the_prompt_on_a_boundary():
    s = WorkloadSettings(requests=400, seed=2, page_size=4, track_interval=16)
    w = build_workload(s)
    lengths = set(boundary_lengths(4, 16))
    firsts = [len(w.system_prompts[x.system_index]) + len(x.steps[0].pieces[0].ids) for x in w.sessions]
    on = sum(n in lengths for n in firsts)
    assert 0.4 < on / len(firsts) < 0.9, on / len(firsts)


def test_the_workload_is_deterministic_by_seed():
    s = WorkloadSettings(requests=80, seed=9)
    assert build_workload(s) == build_workload(s)
    assert build_workload(s) != build_workload(WorkloadSettings(requests=80, seed=10))


@pytest.mark.parametrize(
    "changes, match",
    [({"requests": 0}, "requests"), ({"page_size": 0}, "page_size"), ({"token_low": 9, "token_high": 9}, "token_low")],
)
def test_bad_settings_are_refused(changes, match):
    with pytest.raises(ValueError, match=match):
        build_workload(WorkloadSettings(**{"requests": 10, **changes}))


def reply(ids, tops=None, text=None):
    keys = tuple(str(t) for t in ids)
    return Reply(text or "".join(chr(97 + t % 26) for t in ids), keys, "id", tops, None, tuple(ids), "length")


def top(**values):
    return {k.lstrip("t"): v for k, v in values.items()}


def test_identical_tokens_agree_and_a_mismatch_is_found_at_its_position():
    assert compare(reply([1, 2, 3]), reply([1, 2, 3])).divergence is None
    d = compare(reply([1, 2, 3]), reply([1, 9, 3])).divergence
    assert (d.position, d.unit, d.expected, d.got) == (1, "token", "2", "9")
    d = compare(reply([1, 2, 3]), reply([1, 2])).divergence  # shorter: ends where the reference goes on
    assert (d.position, d.expected, d.got) == (2, "3", "<end: length>")


def test_near_tie_rule():
    tops = (top(t1=-0.1), top(t2=-0.5, t7=-0.55, t8=-0.9, t3=-1, t4=-2, t5=-3, t6=-4), top(t3=-0.2))
    ref = reply([1, 2, 3], tops)
    assert is_near_tie(ref, 1, "7", 0.1) and not is_near_tie(ref, 1, "7", 0.01)
    assert not is_near_tie(ref, 1, "6", 10.0)  # sixth best: outside the top 5
    assert not is_near_tie(reply([1, 2, 3]), 1, "7", 1.0)  # no top logprobs: never a tie
    c = compare(ref, reply([1, 7, 99]), near_tie=0.1)  # forgiven; the rest (99) is not compared
    assert c.divergence is None and c.near_tie.position == 1
    assert compare(ref, reply([1, 8, 3]), near_tie=0.1).divergence.position == 1  # 0.4 below: not a tie
    assert compare(ref, reply([1, 7, 3])).divergence is not None  # exact mode forgives nothing


def test_without_tokens_the_text_is_compared():
    c = compare(Reply("hello world"), Reply("hello word"))
    assert c.unit == "char" and (c.divergence.position, c.divergence.expected) == (9, "'ld'")
    assert compare(Reply("same"), reply([1])).unit == "char"  # one side has no tokens
    assert compare(Reply("same"), Reply("same")).divergence is None


def test_parse_choice_reads_token_ids_and_top_logprobs():
    choice = {
        "text": "ab",
        "finish_reason": "stop",
        "logprobs": {
            "tokens": ["token_id:5", "token_id:6"],
            "top_logprobs": [{"token_id:5": -0.1, "token_id:9": -2.0}, {"token_id:6": -0.3}],
            "text_offset": [0, 1],
        },
    }
    r = parse_choice(choice)
    assert (r.keys, r.kind, r.token_ids, r.offsets) == (("5", "6"), "id", (5, 6), (0, 1))
    assert r.tops[0] == {"5": -0.1, "9": -2.0}
    s = parse_choice({"text": "ab", "token_ids": [5, 6], "logprobs": {"tokens": ["a", "b"], "top_logprobs": None}})
    assert (s.keys, s.kind, s.token_ids, s.tops) == (("a", "b"), "str", (5, 6), None)
    assert parse_choice({"text": "ab"}).keys is None
    with pytest.raises(ValueError, match="no text"):
        parse_choice({"logprobs": None})


def test_json_check():
    ask, prefix = json_request("read_file", first=True)
    assert ask.endswith(prefix) and json_parses(prefix, "}}")
    assert json_parses(prefix, '"path": "a.py"}}\n</tool_call> trailing') and not json_parses(prefix, '"path": ')
    good, bad = Reply('"path": "a.py"}}'), Reply('"path: "a.py"}}')
    assert is_malformed_json(prefix, good, bad) and not is_malformed_json(prefix, bad, good)
    assert not is_malformed_json(prefix, bad, bad)  # the reference's does not parse either
