"""side_by_side.py: server start / health wait / stop (server_process.py, with a stand-in server speaking issue
#4's flags), serve.run over real HTTP, the comparison table; the whole run under --oracle-python."""

import json
import os
import re
import stat
import sys
from pathlib import Path

import httpx
import pytest

from serving.bench import make_checkpoints, serve, side_by_side
from serving.bench.server_process import free_port, server_process

FAKE = Path(__file__).with_name("fake_openai_server.py")
TOKEN_INTERVAL_S = 0.010  # the stand-in server's pacing (fake_openai_server.TOKEN_INTERVAL_S)


def _fake_python(tmp_path: Path) -> str:
    """An executable that takes '<python> -m serving.server FLAGS' and starts the stand-in server."""
    wrapper = tmp_path / "fake-python"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return str(wrapper)


def _args(tmp_path, *extra):
    return side_by_side.build_parser().parse_args(
        ["--model", str(tmp_path / "ours"), "--hf-model", str(tmp_path / "hf"), "--hf-python", "unused",
         "--server-python", _fake_python(tmp_path), "--log-dir", str(tmp_path / "logs"), "--num-prompts", "6",
         "--concurrency", "3", "--input-len", "40", "--output-len", "5", "--num-warmups", "1", *extra])


def test_server_is_started_health_checked_measured_and_stopped(tmp_path):
    args = _args(tmp_path, "--max-model-len", "64")
    port = free_port()
    cmd = side_by_side.server_command(args, port)
    assert cmd[1:3] == ["-m", "serving.server"] and cmd[cmd.index("--max-num-seqs") + 1] == "3"
    with server_process(cmd, port, tmp_path / "server.log", startup_timeout=60) as url:
        assert httpx.get(url + "/health").status_code == 200
        res = side_by_side.run_client(url, args.served_model_name, args, "10,500", tmp_path / "ours.json")
        flags = ["--base-url", url, "--model", args.served_model_name, "--max-concurrency", "3", "--ignore-eos"]
        # an over-long prompt is rejected by the server; the client counts it and carries on
        over = serve.run(serve.parse_args(flags + ["--num-prompts", "1", "--input-len", "80"]))
    with pytest.raises(httpx.HTTPError):
        httpx.get(url + "/health", timeout=2)  # stopped
    s = res["summary"]
    assert (s["completed"], s["failed"], s["total_output_tokens"]) == (6, 0, 30)
    # TPOT reflects the server's pacing: a late first chunk can shorten the measured span by a few ms, never halve it
    assert s["total_input_tokens"] == 240 and s["median_tpot_ms"] >= 0.5e3 * TOKEN_INTERVAL_S
    assert over["summary"]["failed"] == 1 and "max_model_len 64" in over["errors"][0]["error"]
    assert json.loads((tmp_path / "ours.json").read_text())["summary"]["completed"] == 6  # run_client wrote it


def test_server_that_dies_is_reported_with_its_log(tmp_path):
    cmd = [sys.executable, "-c", "import sys; print('cannot load model'); sys.exit(3)"]
    with (pytest.raises(RuntimeError, match="(?s)code 3.*cannot load model"),
          server_process(cmd, free_port(), tmp_path / "s.log", startup_timeout=60)):
        pass
    with (pytest.raises(RuntimeError, match="(?s)code 3.*its output was not kept"),
          server_process(cmd, free_port(), None, startup_timeout=60)):  # decode_overhead keeps no log
        pass


def test_comparison_rows_and_table():
    ours = {"summary": {"output_throughput": 300.0, "total_token_throughput": 3000.0, "request_throughput": 4.0,
                        "median_ttft_ms": 50.0, "median_tpot_ms": 5.0, "p90_interactivity_tok_s": 190.0,
                        "failed": 0}}
    hf = {"summary": {"output_throughput": 30.0, "total_token_throughput": 600.0, "request_throughput": 0.5,
                      "median_ttft_ms": 200.0, "median_tpot_ms": 40.0, "p90_interactivity_tok_s": 24.0}}
    rows = {r["metric"]: r for r in side_by_side.comparison(ours, hf)}
    assert rows["output_throughput"]["ratio_ours_over_hf"] == pytest.approx(10.0)
    assert rows["median_tpot_ms"]["ratio_ours_over_hf"] == pytest.approx(0.125)
    ident = {"path": "p", "model_type": "deepseek_v41", "parameters": 2.0e6}
    table = side_by_side.format_table({
        "workload": {"num_prompts": 1, "input_len": 1, "output_len": 1, "concurrency": 1, "dtype": "float32",
                     "token_id_range": "10,20", "seed": 0},
        "models": {"ours": ident, "hf": {**ident, "model_type": "deepseek_v4"}},
        "rows": list(rows.values()), "ours": ours})
    assert "deepseek_v41, 2.00M params" in table and "deepseek_v4, 2.00M params" in table
    assert re.search(r"Output tok/s +300\.00 +30\.00 +10\.00  higher", table)
    assert re.search(r"TPOT median \(ms\) +5\.00 +40\.00 +0\.12  lower", table)


def test_whole_side_by_side_run(tmp_path, oracle_python):
    if not oracle_python:
        pytest.skip("pass --oracle-python=PYTHON (torch 2.13 + transformers 5.24) to run the HF side")
    v4, v41 = make_checkpoints.release_configs("tiny")
    make_checkpoints.write_checkpoint(tmp_path / "hf", v4, seed=0, dtype="float32")
    make_checkpoints.write_checkpoint(tmp_path / "ours", v41, seed=0, dtype="float32")
    out = tmp_path / "sbs.json"
    args = ["--model", str(tmp_path / "ours"), "--hf-model", str(tmp_path / "hf"), "--hf-python", oracle_python,
            "--server-python", _fake_python(tmp_path), "--log-dir", str(tmp_path / "logs"), "--num-prompts", "4",
            "--concurrency", "2", "--input-len", "24", "--output-len", "3", "--num-warmups", "0",
            "--dtype", "float32", "--hf-threads", "1", "--output-json", str(out)]
    assert side_by_side.main(args) == 0
    res = json.loads(out.read_text())
    assert res["workload"]["token_id_range"] == "10,512"
    assert res["models"]["ours"]["model_type"] == "deepseek_v41" and res["models"]["hf"]["model_type"] == "deepseek_v4"
    for side in ("ours", "hf"):
        s = res[side]["summary"]
        assert (s["completed"], s["total_input_tokens"], s["total_output_tokens"]) == (4, 96, 12)
    assert all(r["ours"] is not None and r["hf"] is not None for r in res["rows"])
    assert not any(p.name.startswith("server-") and os.path.getsize(p) and b"Traceback" in p.read_bytes()
                   for p in (tmp_path / "logs").iterdir())
