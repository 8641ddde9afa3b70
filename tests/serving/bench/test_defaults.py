"""The defaults benchmark's rule (the highest worst-point ratio to the best candidate; near-ties to the fewest
programs), its candidate flags and its table."""

import pytest

from serving.bench.defaults import Candidate, choose, format_table, main, parse_candidate

MEDIANS = {"defaults": {"peers c=8": 80.0, "agentic c=2": 10.0},
           "big": {"peers c=8": 100.0, "agentic c=2": 9.0},
           "small": {"peers c=8": 50.0, "agentic c=2": 10.2}}


def test_the_default_is_the_best_worst_case_and_near_ties_go_to_fewer_programs():
    got = choose(MEDIANS, {"defaults": 17, "big": 21, "small": 15})
    assert got["ratios"]["big"] == {"peers c=8": 1.0, "agentic c=2": pytest.approx(9.0 / 10.2)}
    assert got["scores"]["small"] == 0.5 and got["scores"]["defaults"] == pytest.approx(0.8)
    assert got["chosen"] == "big" and got["tied"] == ["big"]  # 0.88 against the defaults' 0.80
    # within the tie margin the fewest programs win, whichever scored a little higher
    tied = choose(MEDIANS, {"defaults": 17, "big": 21, "small": 15}, tie=0.1)
    assert tied["tied"] == ["defaults", "big"] and tied["chosen"] == "defaults"
    assert choose(MEDIANS, {"defaults": 30, "big": 21, "small": 15}, tie=0.1)["chosen"] == "big"


def test_candidates_are_a_name_and_the_flags_added_to_the_defaults():
    assert parse_candidate("defaults=") == Candidate("defaults", ())
    assert parse_candidate("b=--max-num-batched-tokens 2048 --no-x") == Candidate(
        "b", ("--max-num-batched-tokens", "2048", "--no-x"))
    for bad in ("--max-num-batched-tokens 2048", "a b=--x", "=--x"):
        with pytest.raises(ValueError, match="NAME=FLAGS"):
            parse_candidate(bad)
    with pytest.raises(SystemExit, match="names must differ"):
        main(["--candidate", "a=", "--candidate", "a=--x"])
    with pytest.raises(SystemExit, match="--rounds must be >= 1"):
        main(["--rounds", "0"])
    for bad in ("2,x", "0", ""):
        with pytest.raises(SystemExit, match="--agentic-concurrency: expected positive integers"):
            main(["--agentic-concurrency", bad])


def test_the_table_marks_the_chosen_candidate_and_the_defaults_worst_ratio():
    programs = {"defaults": 17, "big": 21, "small": 15}
    rule = choose(MEDIANS, programs)
    cold = {n: {"programs": p, "all_compiled_s": 100.0 + p} for n, p in programs.items()}
    rounds = {n: [m, m] for n, m in MEDIANS.items()}
    candidates = {"defaults": [], "big": ["--max-num-batched-tokens", "2048"], "small": ["--x"]}
    table = format_table({"model": "m", "rule": "r", "candidates": candidates, "cold": cold, "rounds": rounds,
                          "medians": MEDIANS, **rule})
    lines = table.splitlines()
    assert "medians of 2 rounds" in lines[0]
    assert lines[1].split(" | ") == ["candidate", "programs", "all compiled s", "peers c=8", "agentic c=2", "score"]
    assert lines[3].startswith("big | 21 | 121 | 100 (1.00) | 9.00 (0.88)") and lines[3].endswith("<- chosen")
    assert lines[-1] == "the defaults' worst ratio to the best: 0.80 (bar 0.90)"
    candidates["defaults"] = ["--y"]  # no candidate is the defaults: no such line
    assert "defaults' worst" not in format_table({"model": "m", "rule": "r", "candidates": candidates, "cold": cold,
                                                  "rounds": rounds, "medians": MEDIANS, **rule})
