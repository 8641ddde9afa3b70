"""The benchmark's CPU smoke path: every case runs (kernels interpreted), agrees with its check, and the
JSON report carries the table's numbers; the optional tokamax comparison's glue against the reference."""

import json
import types

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import moe_gmm
from serving.bench import kernels as bench
from tests.pallas_kernels.util import assert_close, seeded_rng


def test_smoke_run_writes_report(tmp_path, capsys):
    out = tmp_path / "bench.json"
    report = bench.main(["--smoke", "--reps", "1", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["results"] == json.loads(json.dumps(report["results"]))
    assert len(saved["results"]) == 8 and saved["ceilings"]["copy_bytes_per_s"] > 0
    for r in saved["results"]:
        assert r["max_abs_diff_vs_check"] < 5e-2 and r["rel_err_vs_check"] < 2e-2, r  # bf16 inputs
        assert r.get("id_overlap_vs_check", 1.0) == 1.0, r
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


def test_a_failing_case_is_reported_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    """A case that fails to build or to run is an error row, the next cases still run, every row is in the JSON
    as soon as it is measured, and cases not started within --max-seconds are skipped rows."""
    x = jnp.arange(8.0)
    ok = bench.Case("double", (x,), lambda a: 2 * a, lambda a: a + a, lambda a: 2 * a, 64.0, 8.0)
    bad = ok._replace(name="broken", kernel=lambda a: a.reshape(3))

    def built_after_a_failure():
        written = json.loads(out.read_text())["results"]  # each row is written before the next case starts
        assert [r["kernel"] for r in written] == ["double", "broken", "big"]
        return ok

    def cannot_build():
        raise MemoryError("no room")

    monkeypatch.setattr(bench, "cases", lambda smoke, seed: [("double", lambda: ok), ("broken", lambda: bad),
                                                             ("big", cannot_build), ("double", built_after_a_failure)])
    out = tmp_path / "bench.json"
    report = bench.run(True, 2, 0, out=str(out))
    rows = report["results"]
    assert [r["kernel"] for r in rows] == ["double", "broken", "big", "double"]
    assert rows[0]["max_abs_diff_vs_check"] == 0 and rows[0]["pallas_s"] > 0 and rows[3]["pallas_s"] > 0
    assert "TypeError" in rows[1]["error"] and "MemoryError: no room" in rows[2]["error"]
    assert json.loads(out.read_text())["results"] == json.loads(json.dumps(rows))
    assert "broken" in capsys.readouterr().out
    skipped = bench.run(True, 1, 0, max_seconds=0.0)["results"]
    assert len(skipped) == 4 and all("skipped" in r for r in skipped)

    def faults(a):
        raise RuntimeError("INTERNAL: CUDA error: CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access")

    faulty = ok._replace(name="faulty", kernel=faults)
    monkeypatch.setattr(bench, "cases", lambda smoke, seed: [("faulty", lambda: faulty), ("double", lambda: ok)])
    after = bench.run(True, 1, 0)["results"]  # a faulted device context fails every later call: not run
    assert "ILLEGAL_ADDRESS" in after[0]["error"] and "faulted in faulty" in after[1]["skipped"]


def test_only_builds_the_cases_it_selects_with_the_full_runs_inputs(monkeypatch):
    """--only filters by name before building (the full-size MoE cases build 7 / 27 GB of expert stacks), and a
    case draws the same inputs whether or not the cases before it ran."""
    built = []
    build = bench._mhc_case
    monkeypatch.setattr(bench, "_mhc_case", lambda rng, name, **kw: built.append(name) or build(rng, name, **kw))
    names = [name for name, _ in bench.cases(True, 0)]
    assert len(names) == 8 and len(set(names)) == 8 and "mhc_post_pre T=5" in names
    full = {name: make() for name, make in bench.cases(True, 3) if name.startswith(("mhc", "router"))}
    assert built == ["mhc_post_pre T=5"]
    alone = dict(bench.cases(True, 3))["mhc_post_pre T=5"]()
    assert alone.name == "mhc_post_pre T=5"
    for a, b in zip(jax.tree.leaves(alone.args), jax.tree.leaves(full["mhc_post_pre T=5"].args)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    monkeypatch.setattr(bench, "measure", lambda case, *a, **k: {"kernel": case.name, "error": "not timed here"})
    built.clear()
    rows = bench.run(True, 1, 0, only=("router",))["results"]
    assert [r["kernel"] for r in rows] == ["router T=5"] and built == []


def test_timed_inputs_are_rotated_copies_of_the_small_arrays(monkeypatch):
    monkeypatch.setattr(bench, "SHARED_BYTES", 1000)
    small, big = jnp.ones(4), jnp.ones(1000, jnp.uint8)
    sets = bench._rotated((small, big, "mxfp4"), nbytes=60e6)
    assert len(sets) == 4  # 4 x L2 / 60 MB
    assert all(s[1] is big and s[2] == "mxfp4" for s in sets)
    assert len({id(s[0]) for s in sets}) == 4 and all(np.array_equal(s[0], small) for s in sets)
    assert len(bench._rotated((small,), nbytes=1e9)) == 1


def test_compare_reports_float_errors_and_id_set_overlap():
    """Row ids in another order are the same selection; a replaced id lowers that row's overlap; -1 is padding."""
    ids = np.array([[4, 2, 9, -1], [1, 3, 5, 7]], np.int32)
    same = np.array([[9, 4, 2, -1], [7, 5, 3, 1]], np.int32)
    other = np.array([[9, 4, 2, -1], [7, 5, 3, 0]], np.int32)
    assert bench.compare((same,), (ids,)) == {"max_abs_diff_vs_check": 0.0, "rel_err_vs_check": 0.0,
                                              "id_overlap_vs_check": 1.0}
    assert bench.compare((other,), (ids,))["id_overlap_vs_check"] == (1 + 3 / 4) / 2
    ref = np.array([3.0, 4.0], np.float32)
    got = bench.compare(ref + np.array([0.0, 0.5], np.float32), ref)
    assert got["max_abs_diff_vs_check"] == 0.5 and abs(got["rel_err_vs_check"] - 0.1) < 1e-12
    assert "id_overlap_vs_check" not in got


def test_several_input_copies_are_timed_in_one_program():
    """With copies, one jitted program runs the op on each (per-call time = its time / copies); the result of
    each copy is computed (distinct buffers), not one result reused."""
    calls = []
    fn = lambda a: calls.append(a.shape) or a * 2.0
    sets = bench._rotated((jnp.arange(4.0),), nbytes=1.0, copies=3)
    t = bench._seconds_per_call(fn, sets, reps=2, calls=1)
    assert t > 0 and len(calls) == 3  # traced once, with the op three times in the program
    many = jax.jit(lambda s: [fn(*a) for a in s])
    assert len(many.lower(sets).compile().as_text().split("multiply")) - 1 >= 3
