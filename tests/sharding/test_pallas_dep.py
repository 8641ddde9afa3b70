"""The Pallas kernels (interpreted on CPU) inside the runtime's per-rank shard_map: dp2 x tp2 with the request
on rank 1 gives the reference-ops model's logits, and each tp rank's attention kernel runs on its own half of
the heads (a subprocess with 4 virtual devices)."""

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import HANG_TIMEOUT_S, xla_env

ROOT = Path(__file__).resolve().parents[2]


def test_pallas_kernels_run_per_rank():
    env = xla_env(4)
    proc = subprocess.run([sys.executable, "-m", "tests.sharding.pallas_dep_worker"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=HANG_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ranks"] == 2 and out["max_abs_err"] <= 1e-4, out
    # segment 2 runs the attention kernel in the cut layer and every layer after it, each call on its tp rank's
    # heads: XLA cannot split the kernel's custom call on a GPU, so unsplit it would run every head on both
    # devices
    assert out["sparse_mla_heads_in_seg2"] == [out["heads"] // 2] * out["layers_in_seg2"], out
    assert out["layers_in_seg2"] > 1
