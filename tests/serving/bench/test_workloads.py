"""Benchmark workloads: deterministic per seed, exact lengths, shared prefixes, growing multi-turn sessions."""

import pytest

from serving.bench import workloads


def test_random_is_deterministic_per_seed_with_exact_lengths():
    a = workloads.random_sessions(6, 37, 5, token_id_range=(10, 100), seed=3)
    b = workloads.random_sessions(6, 37, 5, token_id_range=(10, 100), seed=3)
    c = workloads.random_sessions(6, 37, 5, token_id_range=(10, 100), seed=4)
    assert a == b and a != c
    assert len(a) == 6 and all(len(s.turns) == 1 for s in a)
    for s in a:
        t = s.turns[0]
        assert t.prompt_len == len(t.prompt_ids) == 37 and t.output_len == 5
        assert all(10 <= i < 100 for i in t.prompt_ids)
    assert len({tuple(s.turns[0].prompt_ids) for s in a}) == 6


def test_random_range_ratio_spreads_lengths_within_bounds():
    sessions = workloads.random_sessions(200, 100, 20, range_ratio=0.5, seed=0)
    lens = [s.turns[0].prompt_len for s in sessions]
    outs = [s.turns[0].output_len for s in sessions]
    assert min(lens) >= 50 and max(lens) <= 150 and len(set(lens)) > 20
    assert min(outs) >= 10 and max(outs) <= 30 and len(set(outs)) > 5


def test_prefix_repetition_sessions_share_prefixes_and_grow_turn_by_turn():
    P, S, O, turns = 24, 7, 5, 3
    sessions = workloads.prefix_repetition_sessions(9, 3, P, S, O, turns=turns, token_id_range=(10, 500), seed=1)
    assert sessions == workloads.prefix_repetition_sessions(9, 3, P, S, O, turns=turns, token_id_range=(10, 500),
                                                            seed=1)
    assert len({s.session_id for s in sessions}) == 9
    by_prefix = {}
    for s in sessions:
        assert len(s.turns) == turns
        for k, t in enumerate(s.turns):
            assert t.prompt_len == P + S + k * (O + S) == len(t.prompt_ids)
            assert [r for r, _ in t.messages] == ["user"] + ["assistant", "user"] * k
            if k:  # turn k re-sends the whole conversation of turn k-1, then the reply and a new suffix
                assert t.messages[:-2] == s.turns[k - 1].messages
                assert len(t.messages[-2][1]) == O and len(t.messages[-1][1]) == S
        by_prefix.setdefault(s.session_id.split("-")[0], []).append(tuple(s.turns[0].prompt_ids[:P]))
    assert len(by_prefix) == 3
    for firsts in by_prefix.values():
        assert len(firsts) == 3 and len(set(firsts)) == 1  # same prefix within a group
    assert len({f[0] for f in by_prefix.values()}) == 3  # different prefixes across groups
    suffixes = [tuple(s.turns[0].prompt_ids[P:]) for s in sessions]
    assert len(set(suffixes)) == 9


def test_chat_messages_have_one_letter_per_id():
    t = workloads.prefix_repetition_sessions(1, 1, 5, 3, 4, turns=2, seed=0)[0].turns[1]
    msgs = t.chat_messages()
    assert [m["role"] for m in msgs] == ["user", "assistant", "user"]
    assert [len(m["content"]) for m in msgs] == [8, 4, 3]
    assert msgs[0]["content"] == "".join(chr(97 + i % 26) for i in t.messages[0][1])


def test_warmups_share_no_prompt_with_the_workload():
    work = workloads.random_sessions(4, 16, 2, seed=0)
    warm = workloads.warmup_sessions(4, 16, 2, seed=0)
    assert {tuple(s.turns[0].prompt_ids) for s in work}.isdisjoint({tuple(s.turns[0].prompt_ids) for s in warm})


@pytest.mark.parametrize("call, match", [
    (lambda: workloads.random_sessions(0, 10, 2), "num_prompts"),
    (lambda: workloads.random_sessions(2, 10, 2, range_ratio=1.0), "range_ratio"),
    (lambda: workloads.random_sessions(2, 10, 2, token_id_range=(5, 5)), "token_id_range"),
    (lambda: workloads.prefix_repetition_sessions(2, 3, 4, 4, 2), "num_prefixes"),
    (lambda: workloads.prefix_repetition_sessions(2, 1, 4, 4, 2, turns=0), "turns"),
    (lambda: workloads.prefix_repetition_sessions(2, 1, 0, 4, 2), "prefix_len"),
])
def test_bad_parameters_name_the_problem(call, match):
    with pytest.raises(ValueError, match=match):
        call()
