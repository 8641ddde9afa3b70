"""`serving.bench.compile_cache`: two fresh processes on one empty cache, a miss then a logged hit."""

import json

from serving.bench import compile_cache


def test_second_process_hits_the_cache(tmp_path, capsys):
    out = tmp_path / "cc.json"
    assert compile_cache.main(["--layers", "10", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())  # measure() raises unless run 1 missed and run 2 hit
    assert row["layers"] == 10 and row["cold_s"] > 0 and row["cache_hit_s"] > 0
    assert "hit/cold" in capsys.readouterr().out
