"""The benchmark's CPU smoke path: every case runs (kernels interpreted), agrees with its check, and the
JSON report carries the table's numbers; the optional tokamax comparison's glue against the reference."""

import json
import types

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import bench, moe_gmm
from tests.pallas_kernels.util import assert_close, seeded_rng


def test_smoke_run_writes_report(tmp_path, capsys):
    out = tmp_path / "bench.json"
    report = bench.main(["--smoke", "--reps", "1", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["results"] == json.loads(json.dumps(report["results"]))
    assert len(saved["results"]) == 8 and saved["ceilings"]["copy_bytes_per_s"] > 0
    for r in saved["results"]:
        assert r["max_abs_diff_vs_check"] < 5e-2, r  # bf16 inputs
        assert r["pallas_s"] > 0 and r["predicted_h200_s"] > 0
    out = capsys.readouterr().out
    assert "sparse_mla decode B=2" in out and "moe_gmm mxfp4 decode B=5" in out and "fp8_linear wq_b T=5" in out


def _ragged_dot_by_rows(lhs_MK, rhs_GKN, group_sizes_G, preferred_element_type):
    """tokamax.ragged_dot's contract (rows grouped in order by group_sizes), by gathering each row's group."""
    gid = jnp.repeat(jnp.arange(rhs_GKN.shape[0]), group_sizes_G, total_repeat_length=lhs_MK.shape[0])
    return jnp.einsum("mk,mkn->mn", lhs_MK, rhs_GKN[gid], preferred_element_type=preferred_element_type)


def test_tokamax_glue_matches_reference():
    rng, msg = seeded_rng()
    w1, w3, w2 = bench._moe_weights(jax.random.key(int(rng.integers(1 << 30))), True, "bf16")
    T, k, E = 7, 4, w1.shape[0]
    ids = jnp.asarray(np.argsort(rng.random((T, E)), axis=1)[:, :k], jnp.int32)
    wts = jnp.asarray(rng.uniform(0.1, 1, (T, k)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((T, w1.shape[2])), jnp.bfloat16)
    fake = types.SimpleNamespace(ragged_dot=_ragged_dot_by_rows)
    got = bench._tokamax_experts(fake, x, ids, wts, *(jnp.swapaxes(w, 1, 2) for w in (w1, w3, w2)))
    want = moe_gmm.reference(x, ids, wts, w1, w3, w2, limit=bench.MOE_LIMIT)
    assert_close(got, want, msg, rtol=2e-2, atol=2e-2)
