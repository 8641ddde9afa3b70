"""One request served end to end across 2 processes on jax.distributed (2 CPU devices each, DEP dp=2 x
tp=2, experts over all 4 devices): the greedy tokens and every step's logits equal the single-process
model's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

import dsv41

ROOT = Path(__file__).resolve().parents[2]


def test_two_processes_serve_one_request():
    prompt_len, steps = 12, 3
    cmd = [sys.executable, "-m", "sharding.launch", "--num-processes", "2", "--devices-per-process", "2",
           "--data-parallel-size", "2", "--tensor-parallel-size", "2", "--enable-expert-parallel",
           "--preset", "tiny", "--seed", "0", "--prompt-len", str(prompt_len), "--decode-steps", str(steps),
           "--timeout", "240"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["processes"] == 2 and out["devices"] == 4

    model = dsv41.random_model("tiny", seed=0)
    prompt = np.random.default_rng(0).integers(3, model.config.vocab_size - 1, prompt_len)
    assert out["tokens"][:prompt_len] == prompt.tolist()
    ref = model.logits(np.array(out["tokens"]))  # one device, the whole sequence
    got = np.array(out["logits"])
    assert np.abs(got - ref[prompt_len - 1:]).max() <= 1e-5
    assert out["tokens"][prompt_len:] == [int(t) for t in np.argmax(ref[prompt_len - 1:-1], axis=-1)]
