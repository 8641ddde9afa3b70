"""The tile autotuner (`serving.bench.autotune`) in interpret mode: every candidate checked against the reference, a
wrong one never chosen, the table it writes read back by `pallas_kernels.tile_table`, the model's shapes listed as
its layers key them."""

import json
import time

import jax
import jax.numpy as jnp
import pytest

import dsv41
from pallas_kernels import tile_table
from serving.bench import autotune

FP8, MOE = autotune.smoke_shapes()


def test_a_wrong_candidate_is_rejected_and_never_chosen():
    pallas_for, _, _ = autotune.paths(FP8, jnp.float32)

    def kernel_for(t):  # 32-column tiles give wrong outputs
        fn = pallas_for(t)
        return (lambda *a: fn(*a) * 1.1) if t.block_n == 32 else fn

    entry = autotune.tune_one(FP8, 3, jnp.float32, smoke=True, reps=1, tolerance=autotune.TOLERANCE,
                              deadline=time.monotonic() + 600, kernel_for=kernel_for)
    tried = entry["tried"]
    assert entry["candidates"] == len(tried) >= 3 and entry["rejected"] >= 1
    for row in tried:
        assert row["ok"] == (row["tiles"]["block_n"] != 32), row
        assert ("seconds" in row) == row["ok"]  # only passing candidates are timed
    if entry["choice"]["impl"] == "pallas":
        assert entry["choice"]["tiles"]["block_n"] != 32
        assert entry["pallas_s"] == min(r["seconds"] for r in tried if r["ok"]) < entry["xla_s"]
    else:
        assert entry["pallas_s"] >= entry["xla_s"]


def test_a_spent_budget_still_times_the_default():
    entry = autotune.tune_one(MOE, 5, jnp.float32, smoke=True, reps=1, tolerance=autotune.TOLERANCE,
                              deadline=time.monotonic() - 1)
    assert entry["candidates"] == 1 and entry["tried"][0]["tiles"] == tile_table.Tiles()._asdict()
    assert entry["tried"][0]["ok"] and entry["default_pallas_s"] == entry["tried"][0]["seconds"]


def test_the_written_table_reads_back_as_the_runtime_would(tmp_path):
    out = tmp_path / "table.json"
    doc = autotune.run([FP8], (2, 16), jnp.float32, smoke=True, reps=1, tolerance=autotune.TOLERANCE,
                       budget_s=600, out=out)
    kind = jax.devices()[0].device_kind
    entries = tile_table.read(out, kind)
    assert [s.rows for s, _ in entries] == [2, 16] and json.loads(out.read_text())["interpreted"]
    for (shape, choice), written in zip(entries, doc["entries"]):
        assert shape == FP8.key(shape.rows, "float32") and choice.impl == written["choice"]["impl"]


def test_a_rerun_keeps_the_entries_it_does_not_tune_again(tmp_path):
    out = tmp_path / "table.json"
    kw = dict(smoke=True, reps=1, tolerance=autotune.TOLERANCE, budget_s=600, out=out)
    autotune.run([FP8], (2, 16), jnp.float32, **kw)
    doc = autotune.run([MOE], (4,), jnp.float32, **kw)  # another shape: the first run's entries stay
    rows = lambda: sorted((s.kernel, s.rows) for s, _ in tile_table.read(out, jax.devices()[0].device_kind))
    assert rows() == [("fp8_linear", 2), ("fp8_linear", 16), ("moe_gmm", 4)] and len(doc["entries"]) == 3
    autotune.run([FP8], (16,), jnp.float32, **kw)  # the same shape again: replaced, not listed twice
    assert rows() == [("fp8_linear", 2), ("fp8_linear", 16), ("moe_gmm", 4)]


def test_the_model_shapes_are_keyed_as_its_layers_key_them():
    shapes = autotune.gemm_shapes(dsv41.load_config("v41-flash"), jnp.bfloat16)
    families = {(g.kernel, g.dims, g.weights) for g in shapes}
    assert ("fp8_linear", (32768, 1280), "fp8 32x32") in families  # wq_b, spec §6
    assert ("moe_gmm", (384, 2304, 2560), "mxfp4") in families  # w1 [E, I, D / 2] packed
    assert all(g.top_k == 6 for g in shapes if g.kernel == "moe_gmm")
    assert len(families) == len(shapes)


def test_unknown_kernels_are_refused():
    with pytest.raises(SystemExit):
        autotune.main(["--smoke", "--kernels", "fp8_linear,conv"])
