"""The full-speed benchmark's rule (five waves in a row at >= 75% of the warm median) and its table."""

from serving.bench.full_speed import full_speed_at, format_table, summarize


def _waves(rates):
    return [{"start_s": 10.0 * i, "end_s": 10.0 * i + 9, "output_tok_s": r, "median_ttft_ms": 1.0,
             "median_tpot_ms": 1.0, "output_tokens": 100, "failed": 0} for i, r in enumerate(rates)]


def test_full_speed_starts_at_the_first_of_five_waves_in_a_row_at_three_quarters_of_the_warm_median():
    assert full_speed_at(_waves([10, 80, 80, 80, 80, 70, 80, 80, 80, 80, 80, 10]), 100) == 60.0  # 70 < 75 breaks it
    assert full_speed_at(_waves([75, 75, 75, 75, 75]), 100) == 0.0
    assert full_speed_at(_waves([100, 100, 100, 100]), 100) is None  # four waves are not five
    assert full_speed_at(_waves([100, 100, 100, 74.9, 100, 100]), 100) is None


def test_the_table_shows_each_run_and_when_all_programs_compiled():
    cold = summarize({"ready_s": 38.3, "all_compiled": "all programs compiled 99.0s after launch", "waves":
                      _waves([50, 90, 90, 90, 90, 90])}, 100)
    warm = summarize({"ready_s": 5.8, "all_compiled": None, "waves": _waves([90] * 6)}, 100)
    table = format_table({"model": "m", "server_args": [], "rule": "r", "warm_median_output_tok_s": 100,
                          "engines": {"ours cold": cold, "ours warm": warm}})
    assert cold["full_speed_at_s"] == 10.0 and cold["median_output_tok_s_after_first"] == 90
    assert cold["output_tokens_served_by_s"] == {60: 600, 120: 600, 180: 600, 240: 600, 300: 600}  # 6 waves by 59 s
    assert summarize({"ready_s": 1, "waves": _waves([1] * 30)}, 1)["output_tokens_served_by_s"][120] == 1200
    assert "ours cold" in table and "all programs compiled 99.0s" in table and "never" not in table
    assert table.splitlines()[-2].startswith("ours warm") and " 0.0 " in table.splitlines()[-2]
    assert table.splitlines()[-1].strip().startswith("output tokens served by 60 s: 600")
