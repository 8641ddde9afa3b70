"""The agentic sweep end to end: our server (tiny preset, compiled steps from the shared XLA cache)
started and stopped by the sweep, two concurrencies of a few seconds each with no errors, the tables, the
JSON and the plot; and flags that are wrong are named before any server starts."""

import json

import pytest

from serving.bench import agentic
from tests.conftest import XLA_CACHE

pytestmark = pytest.mark.slow  # the second tier (`make test-slow`; tests/README.md)

# test_server.py's runtime flags: the same compiled steps, so a warm cache serves both
SERVER_ARGS = ("--max-num-seqs 8 --max-num-batched-tokens 64 --token-buckets 8,16,32,64 --disable-access-log "
               f"--compilation-cache-dir {XLA_CACHE}")


def test_short_sweep_against_our_server_writes_json_and_plots(tmp_path):
    args = agentic.parse_args(["--concurrency", "1,2", "--duration-s", "3", "--variants", "replay-on",
                               "--out-dir", str(tmp_path), f"--server-args={SERVER_ARGS}"])
    lines = []
    result = agentic.run_sweep(args, echo=lines.append)
    points = result["variants"][0]["points"]
    assert [p["concurrency"] for p in points] == [1, 2]
    for p in points:
        s = p["summary"]
        assert (s["failed"], s["warmup_failed"], s["errors_by_kind"]) == (0, 0, {})
        assert s["completed"] >= 3 and p["trees_started"] >= p["concurrency"]
        # the server's cache cannot beat an ideal one; multi-turn trees do hit it
        assert 0 < s["prefix_hit_rate"] <= s["theoretical_prefix_hit_rate"] + 1e-9
        assert s["p90_interactivity_tok_s"] > 0 and s["p90_itl_ms"] > 0 and s["p99_ttft_ms"] > 0
        assert s["total_token_throughput"] > s["output_throughput"] > 0  # input (cached included) counts
        assert s["acceptance_length"] is None
    assert points[0]["salt"] != points[1]["salt"]  # the second point shares no tree prefix with the first
    assert (tmp_path / "agentic.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((tmp_path / "agentic.json").read_text())
    assert saved["variants"][0]["points"][1]["summary"] == points[1]["summary"]
    assert saved["workload"]["block_size"] == 16 and "--swa-bounded-replay" in saved["variants"][0]["server_flags"]
    table = lines[-2]
    assert table.splitlines()[0].split()[:3] == ["variant", "conc", "req/s"] and len(table.splitlines()) == 3
    assert "concurrency 2" in "\n".join(lines)


@pytest.mark.parametrize("flags, needle", [
    (["--variants", "replay-on,fast"], "--variants: unknown ['fast']"),
    (["--concurrency", "0,2"], "--concurrency"),
    (["--max-context", "64"], "max_context 64 cannot hold a first prompt"),
    (["--dp-mirror", "--duration-s", "5"], "need --num-sessions"),
    (["--dp-size", "1", "--variants", "dp-load", "--num-sessions", "2"], "--dp-size must be >= 2"),
    (["--token-id-range", "10"], "--token-id-range: expected LOW,HIGH"),
])
def test_bad_flags_are_named_before_a_server_starts(flags, needle, capsys):
    argv = ["--server-python", "/nonexistent/python", "--duration-s", "1", *flags]
    assert agentic.main(argv) == 2
    assert needle in capsys.readouterr().err
