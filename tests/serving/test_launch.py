"""Requests served end to end by the engine across 2 processes on jax.distributed (2 CPU devices each, DEP
dp=2 x tp=2, experts over all 4 devices): two sessions land on the two data-parallel ranks (one per
process, each rank's KV on its own process's devices), and each request's greedy tokens and log-probabilities
are the single-process model's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

import dsv41

ROOT = Path(__file__).resolve().parents[2]


def test_two_processes_serve_requests_end_to_end():
    prompt_len, steps = 12, 3
    cmd = [sys.executable, "-m", "serving.launch", "--num-processes", "2", "--devices-per-process", "2",
           "--data-parallel-size", "2", "--tensor-parallel-size", "2", "--enable-expert-parallel",
           "--preset", "tiny", "--seed", "0", "--prompt-len", str(prompt_len), "--decode-steps", str(steps),
           "--num-requests", "2", "--timeout", "400"]  # no persistent XLA cache: see serving.launch's flag
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=450, env=dict(os.environ))
    errors = "\n".join(ln for ln in proc.stderr.splitlines() if not ln.startswith("[Gloo]"))
    assert proc.returncode == 0, errors[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (out["processes"], out["devices"], out["data_parallel_ranks"]) == (2, 4, 2)
    assert sorted(out["ranks"].values()) == [0, 1]  # one request per rank, i.e. per process

    model = dsv41.random_model("tiny", seed=0)
    for i, prompt in enumerate(out["prompts"]):
        got = out["outputs"][f"r{i}"]
        seq = np.array(prompt + got["tokens"])
        logits = model.logits(seq)[prompt_len - 1:-1]  # one device, the whole sequence
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        assert got["tokens"] == [int(t) for t in logp.argmax(-1)]
        assert np.abs(np.array(got["logprobs"]) - logp[np.arange(steps), got["tokens"]]).max() <= 1e-5
        top = np.array([[lp for _, lp in row] for row in got["top"]])
        assert np.abs(top - np.sort(logp, -1)[:, ::-1][:, : top.shape[1]]).max() <= 1e-5
