"""`serving.bench.peers`: what its committed JSON names the checkpoint by; one server measured at each
concurrency (the stand-in server of the side-by-side tests)."""

import argparse
import sys
from pathlib import Path

from serving.bench.peers import _measure_server, _portable
from serving.bench.server_process import free_port

FAKE = Path(__file__).with_name("fake_openai_server.py")


def test_the_json_names_no_folder_of_this_machine(monkeypatch):
    monkeypatch.setenv("PEER_DIR", "/data/peer/")
    assert _portable("/data/peer/tiny-v4") == "$PEER_DIR/tiny-v4"
    assert _portable("/elsewhere/ckpts/tiny-v4") == "tiny-v4"  # outside $PEER_DIR: the folder's name
    monkeypatch.delenv("PEER_DIR")
    assert _portable("/data/peer/tiny-v4") == "tiny-v4"
    assert _portable("small") == "small"  # a preset or a relative path stays as given


def test_a_server_is_measured_at_each_concurrency(tmp_path):
    """_measure_server (ours and vLLM alike): one start, the client at every concurrency (c=1 with a quarter of
    the prompts, at least 4), each run's JSON in the log folder, the start-to-/health time."""
    port = free_port()
    cmd = [sys.executable, str(FAKE), "--port", str(port), "--served-model-name", "bench-model",
           "--max-model-len", "64"]
    args = argparse.Namespace(log_dir=tmp_path, startup_timeout=60.0, num_prompts=6, input_len=8, output_len=3,
                              seed=0, num_warmups=0)
    res = _measure_server(args, "fake", cmd, port, [1, 2], "10,500")
    assert res["ready_s"] > 0 and sorted(res["runs"]) == [1, 2]
    assert [res["runs"][c]["completed"] for c in (1, 2)] == [4, 6]
    assert res["runs"][2]["total_output_tokens"] == 18
    assert (tmp_path / "fake-c1.json").is_file() and (tmp_path / f"fake-{port}.log").is_file()
