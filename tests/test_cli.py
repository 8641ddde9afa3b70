"""`python -m dsv41.logits` on a tiny release checkpoint: same logits as the API, clear errors."""

import subprocess
import sys

import numpy as np
import pytest

import dsv41
from tests.conftest import HANG_TIMEOUT_S
from tests.release_checkpoint import write_release


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_release(tmp_path_factory.mktemp("tiny"), "tiny", seed=7)


def _run(*args):
    return subprocess.run([sys.executable, "-m", "dsv41.logits", *map(str, args)], capture_output=True, text=True,
                          timeout=HANG_TIMEOUT_S)


def test_logits_cli_matches_api(ckpt, tmp_path):
    out = tmp_path / "l.npy"
    r = _run(ckpt, "--input-ids", "0,17,5,300,2,9,11,4,4,4,8", "--fake-quant", "--out", out)
    assert r.returncode == 0, r.stderr
    got = np.load(out)
    want = dsv41.load(ckpt).logits(np.array([0, 17, 5, 300, 2, 9, 11, 4, 4, 4, 8]), fake_quant=True)
    assert got.dtype == np.float32 and got.shape == (11, 512)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("args, message", [
    (["--input-ids", "1,x"], "comma-separated integers"),
    (["--input-ids", "1,99999"], "must lie in [0, 512)"),
])
def test_logits_cli_errors(ckpt, tmp_path, args, message):
    r = _run(ckpt, *args, "--out", tmp_path / "x.npy")
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert not (tmp_path / "x.npy").exists()


def test_logits_cli_missing_checkpoint(tmp_path):
    r = _run(tmp_path / "nothing", "--input-ids", "1", "--out", tmp_path / "x.npy")
    assert r.returncode == 2 and "neither a preset" in r.stderr
