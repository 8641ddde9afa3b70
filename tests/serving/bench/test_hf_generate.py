"""hf_generate.py: its workload import pulls in neither jax nor the `serving` package and yields serve.py's
prompts; with --oracle-python (torch + transformers 5.24) it runs on a make_checkpoints V4 checkpoint."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from serving.bench import make_checkpoints, serve
from tests.conftest import HANG_TIMEOUT_S

HF_GENERATE = Path(serve.__file__).with_name("hf_generate.py")
FLAGS = ["--num-prompts", "5", "--input-len", "12", "--output-len", "3", "--range-ratio", "0.25",
         "--token-id-range", "10,300", "--seed", "7"]

_PROBE = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("hf_generate", sys.argv[1])
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
sessions = m.prompts_for(m.build_parser().parse_args(["--model", "unused"] + sys.argv[2:]))
heavy = sorted(k for k in sys.modules if k.split(".")[0] in ("jax", "jaxlib", "flax", "serving", "torch", "dsv41"))
print(json.dumps({"heavy": heavy, "prompts": [s.turns[0].prompt_ids for s in sessions],
                  "outputs": [s.turns[0].output_len for s in sessions]}))
"""


def test_workload_import_needs_no_jax_and_matches_serve_prompts():
    # this interpreter has jax installed, so an accidental import would show up in sys.modules
    out = subprocess.run([sys.executable, "-c", _PROBE, str(HF_GENERATE), *FLAGS], capture_output=True, text=True,
                         check=True, timeout=120)
    got = json.loads(out.stdout)
    assert got["heavy"] == []
    sessions = serve.make_sessions(serve.parse_args(FLAGS))
    assert got["prompts"] == [s.turns[0].prompt_ids for s in sessions]
    assert got["outputs"] == [s.turns[0].output_len for s in sessions]


def test_run_as_a_script_its_folder_shadows_no_package():
    """Run as a script its folder is sys.path[0]: transformers' probe for HF's `kernels` package imported
    serving/bench/kernels.py (and jax with it) until the folder was taken off the path."""
    probe = ("import importlib.util, json, os, runpy, sys\n"
             "sys.path.insert(0, os.path.dirname(sys.argv[1]))\n"  # what `python hf_generate.py` does
             "runpy.run_path(sys.argv[1], run_name='probe')\n"
             "spec = importlib.util.find_spec('kernels')\n"
             "print(json.dumps(spec and spec.origin))")
    out = subprocess.run([sys.executable, "-c", probe, str(HF_GENERATE)], capture_output=True, text=True, check=True,
                         timeout=120)
    origin = json.loads(out.stdout.splitlines()[-1])
    assert origin is None or Path(origin).parent != HF_GENERATE.parent, origin


def test_hf_generate_runs_the_workload_on_a_v4_checkpoint(tmp_path, oracle_python):
    if not oracle_python:
        pytest.skip("pass --oracle-python=PYTHON (torch 2.13 + transformers 5.24) to run HF generate")
    v4, _ = make_checkpoints.release_configs("tiny")
    n_params = make_checkpoints.write_checkpoint(tmp_path / "v4", v4, seed=0, dtype="float32")
    out = tmp_path / "hf.json"
    subprocess.run([oracle_python, str(HF_GENERATE), "--model", str(tmp_path / "v4"), "--batch-size", "2",
                    "--dtype", "float32", "--threads", "1", "--output-json", str(out), *FLAGS],
                   check=True, capture_output=True, timeout=HANG_TIMEOUT_S)
    res = json.loads(out.read_text())
    sessions = serve.make_sessions(serve.parse_args(FLAGS))
    batches = [sessions[i:i + 2] for i in range(0, 5, 2)]
    s = res["summary"]
    assert res["model"]["parameters"] == n_params  # HF loaded every tensor we wrote (it checks missing keys)
    assert [b["batch"] for b in res["batches"]] == [2, 2, 1]
    assert [b["new_tokens"] for b in res["batches"]] == [max(x.turns[0].output_len for x in b) for b in batches]
    assert s["completed"] == 5 and s["failed"] == 0
    assert s["total_input_tokens"] == sum(x.turns[0].prompt_len for x in sessions)
    assert s["total_output_tokens"] == sum(b["batch"] * b["new_tokens"] for b in res["batches"])
    assert s["prefix_hit_rate"] == 0.0 and s["median_ttft_ms"] > 0 and s["median_tpot_ms"] > 0
