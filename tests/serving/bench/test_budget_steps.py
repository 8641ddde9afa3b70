"""The step-budget bench (`serving.bench.budget_steps`): one runner per budget, every round timed on each, the medians
reported are the rounds' medians."""

import json
import statistics

import pytest

from serving.bench import budget_steps

pytestmark = pytest.mark.slow  # the second tier (`make test-slow`; tests/README.md)


def test_each_budget_is_timed_every_round_and_reported_by_its_median(tmp_path, capsys):
    out = tmp_path / "budget_steps.json"
    result = budget_steps.main(["--model", "tiny", "--budgets", "32,64", "--prompt-len", "96", "--decode-context", "8",
                                "--decode-steps", "3", "--rounds", "3", "--compilation-cache-dir", "",
                                "--json", str(out)])
    assert json.loads(out.read_text()) == result
    assert [row["budget"] for row in result["rows"]] == [32, 64]
    for row in result["rows"]:
        rounds = row["rounds"]
        assert len(rounds["prefill_s"]) == len(rounds["decode_ms"]) == 3
        assert row["prefill_s"] == statistics.median(rounds["prefill_s"]) > 0
        assert row["decode_ms"] == statistics.median(rounds["decode_ms"]) > 0
    table = capsys.readouterr().out
    assert "| 32 |" in table and "| 64 |" in table and "prefill of 96 tokens" in table
