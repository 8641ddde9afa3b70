"""The benchmark's CPU smoke path: every case runs (kernels interpreted), agrees with its check, and the
JSON report carries the table's numbers."""

import json

from pallas_kernels import bench


def test_smoke_run_writes_report(tmp_path, capsys):
    out = tmp_path / "bench.json"
    report = bench.main(["--smoke", "--reps", "1", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["results"] == json.loads(json.dumps(report["results"]))
    assert len(saved["results"]) == 6 and saved["ceilings"]["copy_bytes_per_s"] > 0
    for r in saved["results"]:
        assert r["max_abs_diff_vs_check"] < 5e-2, r  # bf16 inputs
        assert r["pallas_s"] > 0 and r["predicted_h200_s"] > 0
    assert "sparse_mla decode B=2" in capsys.readouterr().out
