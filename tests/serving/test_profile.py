"""`python -m serving.profile` end to end on the tiny preset: a trace of a few engine steps, and tables
(printed and JSON) that split the time by engine phase, segment, layer and op."""

import json
import os
import subprocess
import sys
from pathlib import Path

import dsv41
import serving.profile
from tests.conftest import HANG_TIMEOUT_S, XLA_CACHE

ROOT = Path(__file__).resolve().parents[2]
PHASES = {"engine.step", "engine.schedule", "runner.build", "runner.segment1", "runner.segment2", "runner.sample",
          "runner.readback", "engine.detokenize"}
# one 16-row bucket: 3 compiled functions, so the engine builds quickly from the persistent cache
FLAGS = ["--model", "tiny", "--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--token-buckets", "16", "--max-model-len", "64",
         "--block-size", "16", "--compilation-cache-dir", str(XLA_CACHE)]


def test_profile_cli_traces_steps_and_splits_their_time(tmp_path):
    out = tmp_path / "profile.json"
    r = subprocess.run([sys.executable, "-m", "serving.profile", *FLAGS, "--batch", "2", "--input-len", "8",
                        "--output-len", "4", "--steps", "2", "--profile-dir", str(tmp_path / "traces"),
                        "--output-json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=HANG_TIMEOUT_S,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["workload"]["steps"] == 2
    assert Path(res["trace_dir"]).parent == tmp_path / "traces" / "plugins" / "profile"
    assert Path(res["xplane"]).is_file() and Path(res["perfetto_trace"]).is_file()

    phases = {p["name"]: p["count"] for p in res["phases"]}
    # every phase once per traced step; the engine launches each step before making the previous one's text, so
    # the step after the last traced one was scheduled and dispatched in the trace too
    launch = {"engine.schedule", "runner.build", "runner.segment1", "runner.segment2", "runner.sample"}
    assert set(phases) == PHASES and {phases[p] for p in launch} == {3} and {phases[p] for p in PHASES - launch} == {2}
    assert res["unmatched_op_events"] == 0 and res["device_ms"] > 0
    assert res["top_ops"] and all(op["total_ms"] >= 0 and op["count"] > 0 for op in res["top_ops"])
    assert {s["name"] for s in res["segments"]} >= {"segment1", "segment2", "sample"}
    c = dsv41.load_config("tiny")
    cut = c.cut_layer
    expected = ({f"segment1/layer_{i}" for i in range(cut)} | {f"segment1/layer_{cut}_kv_path"}
                | {f"segment2/layer_{i}" for i in range(cut, c.num_hidden_layers)})
    assert expected <= {s["name"] for s in res["layers"]}  # every layer of the model, in its segment
    device_ms = sum(s["total_ms"] for s in res["segments"])
    assert abs(device_ms - res["device_ms"]) < 1e-6 * max(1.0, device_ms)  # the split covers all device time

    for title in ("host time by engine phase", "device self time by segment", "by layer", "top 20 ops"):
        assert title in r.stdout
    assert all(name in r.stdout for name in PHASES)

    # --read gives the same tables for the trace the run left behind
    again = serving.profile.main(["--read", res["trace_dir"]])
    assert {k: again[k] for k in ("phases", "segments", "layers", "top_ops")} == {
        k: res[k] for k in ("phases", "segments", "layers", "top_ops")}
