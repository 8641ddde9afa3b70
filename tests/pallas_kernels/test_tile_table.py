"""The tuned tile tables (`pallas_kernels.tile_table`): the lookup rule, the stored format and its errors, and a
choice reaching the kernels through `KernelConfig`, the model's Linear and Experts, and the runtime's config."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41 import quant
from dsv41.layers.basic import Linear, with_kernels
from pallas_kernels import fp8_linear, tile_table
from pallas_kernels.kernel_config import KernelConfig
from pallas_kernels.tile_table import KernelChoice, KernelShape, Tiles
from tests.pallas_kernels.util import seeded_rng

FP8 = dict(kernel="fp8_linear", dims=(128, 64), weights="fp8 32x32", dtype="float32")
NARROW = KernelChoice("pallas", Tiles(block_n=32, block_k=32))


def _entry(rows, choice, **over):
    return KernelShape(**{**FP8, "rows": rows, **over}), choice


def test_lookup_takes_the_fewest_tuned_rows_at_or_above_the_call_else_the_most():
    table = (_entry(8, NARROW), _entry(64, KernelChoice("xla")))
    call = lambda rows, **over: KernelShape(**{**FP8, "rows": rows, **over})
    assert tile_table.choose(table, call(1)) == NARROW
    assert tile_table.choose(table, call(8)) == NARROW
    assert tile_table.choose(table, call(9)).impl == "xla"
    assert tile_table.choose(table, call(5000)).impl == "xla"
    assert tile_table.choose(table, call(8, dims=(256, 64))) is None  # another weight: the kernel's own rule
    assert tile_table.choose(table, call(8, dtype="bfloat16")) is None


def _doc(kind="Fake GPU", entries=None):
    entries = entries if entries is not None else [
        {"shape": {**FP8, "rows": 8, "dims": [128, 64]}, "choice": {"impl": "pallas", "tiles": NARROW.tiles._asdict()}}]
    return tile_table.to_json(kind, entries, {})


def test_a_stored_table_reads_back_and_is_found_by_device_kind(tmp_path):
    path = tile_table.table_path("Fake GPU", tmp_path)
    assert path.name == "fake-gpu.json"
    path.write_text(json.dumps(_doc()))
    assert tile_table.stored("Fake GPU", tmp_path) == (_entry(8, NARROW),)
    assert tile_table.stored("Other GPU", tmp_path) == ()  # none tuned for it
    assert tile_table.for_runtime("none", "Fake GPU", tmp_path) == ()
    assert tile_table.for_runtime(str(path), "Other GPU", tmp_path) == (_entry(8, NARROW),)  # a named table


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(version=0), "version"),
    (lambda d: d.update(device_kind="Other GPU"), "tuned on 'Other GPU'"),
    (lambda d: d["entries"][0]["choice"].update(impl="cuda"), "impl"),
    (lambda d: d["entries"][0]["choice"]["tiles"].update(block_n=48), "block_n"),
    (lambda d: d["entries"][0]["shape"].update(kernel="conv"), "kernel"),
    (lambda d: d["entries"].append({**d["entries"][0], "choice": {"impl": "pallas", "tiles": {"block_m": 16}}}),
     "listed twice"),
    (lambda d: d.pop("entries"), "entries")])
def test_a_bad_table_is_refused_naming_the_file_and_the_problem(tmp_path, change, message):
    doc = _doc()
    change(doc)
    path = tmp_path / "fake-gpu.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=message) as err:
        tile_table.read(path, "Fake GPU")
    assert str(path) in str(err.value)


def test_kernel_config_hands_out_choices_only_where_pallas_runs(monkeypatch):
    import pallas_kernels.dispatch as dispatch

    tuned = (_entry(8, NARROW),)
    call = KernelShape(**{**FP8, "rows": 3})
    assert KernelConfig("auto", tuned=tuned).choice(call) is None  # auto on a CPU: xla, tiles irrelevant
    assert KernelConfig("pallas", tuned=tuned).choice(call) == NARROW
    assert KernelConfig("xla", tuned=tuned).choice(call) is None
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "gpu")
    assert KernelConfig("auto", tuned=tuned).choice(call) == NARROW
    with pytest.raises(ValueError, match="listed twice"):
        KernelConfig(tuned=tuned + tuned)
    assert "1 tuned GEMM shapes" in KernelConfig("pallas", tuned=tuned).describe()


def _grids(fn, *args) -> list[tuple]:
    """The grid of every pallas_call in fn's jaxpr."""
    jaxpr = jax.make_jaxpr(fn)(*args)
    return [e.params["grid_mapping"].grid for e in jaxpr.eqns if e.primitive.name == "pallas_call"]


def _fp8_weight(rng, O, I):
    q, s = quant.quantize_fp8_blocks(rng.standard_normal((O, I)).astype(np.float32) / np.sqrt(I), (32, 32))
    return jnp.asarray(q), jnp.asarray(s)


def test_the_dispatch_runs_a_choice_under_auto_and_only_its_tiles_under_pallas(monkeypatch):
    import pallas_kernels.dispatch as dispatch

    rng, seed = seeded_rng()
    w, s = _fp8_weight(rng, 128, 64)
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    kw = dict(block=(32, 32), dtype=jnp.float32)
    f = lambda impl, choice: (lambda x: fp8_linear.fp8_linear(x, w, s, **kw, impl=impl, choice=choice))
    assert _grids(f("pallas", None), x) == [(1, 2)]  # the default: 64 output columns per program
    assert _grids(f("pallas", NARROW), x) == [(1, 4)]  # the tuned 32
    assert _grids(f("pallas", KernelChoice("xla")), x) == [(1, 2)]  # explicit pallas: tiles only, never "xla"
    want = fp8_linear.reference(x, w, s, **kw, out_dtype=jnp.float32)
    np.testing.assert_allclose(f("pallas", NARROW)(x), want, rtol=0, atol=1e-5 * float(jnp.abs(want).max()),
                               err_msg=seed)
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(fp8_linear, "interpret_default", lambda: True)
    assert _grids(f("auto", KernelChoice("xla")), x) == []  # a table's "xla" wins under auto
    big = jnp.zeros((fp8_linear.AUTO_MAX_ROWS + 1, 64), jnp.float32)
    assert _grids(f("auto", NARROW), big) == [(2, 4)]  # the table overrules the untuned row limit
    assert _grids(f("auto", None), big) == []


def test_the_model_linear_and_experts_pass_their_shapes_tuned_choice():
    rng, seed = seeded_rng()
    lin = Linear(64, 128, dtype=jnp.float32)
    lin.store_fp8((32, 32))
    w, s = _fp8_weight(rng, 128, 64)
    lin.weight.set_value(w)
    lin.scale.set_value(s)
    x = jnp.asarray(rng.standard_normal((2, 3, 64)), jnp.float32)  # 6 rows: the entry tuned at 8 covers them
    tuned = with_kernels(lin, KernelConfig("pallas", tuned=(_entry(8, NARROW),)))
    other = with_kernels(lin, KernelConfig("pallas", tuned=(_entry(8, NARROW, dims=(256, 64)),)))
    assert _grids(lambda x: tuned(x), x) == [(1, 4)]
    assert _grids(lambda x: other(x), x) == [(1, 2)]

    from dsv41.layers.moe import Experts

    E, I, D, k = 4, 64, 64, 2
    ex = Experts(E, D, I, 10.0, dtype=jnp.float32)
    ex.store_mxfp4()
    for name in ex.NAMES:
        values, scale = getattr(ex, name), getattr(ex, name + "_scale")
        values.set_value(jnp.asarray(rng.integers(0, 256, values.get_value().shape), jnp.uint8))
        scale.set_value(jnp.full(scale.get_value().shape, 124, jnp.uint8))  # 2^-3: outputs of order one
    moe = KernelShape("moe_gmm", 5, (E, I, D // 2), "mxfp4", "float32")
    ids = jnp.asarray(np.argsort(rng.random((5, E)), axis=1)[:, :k], jnp.int32)
    wts = jnp.full((5, k), 0.5, jnp.float32)
    xm = jnp.asarray(rng.standard_normal((5, D)), jnp.float32)
    narrow = with_kernels(ex, KernelConfig("pallas", tuned=((moe, NARROW),)))
    plain = with_kernels(ex, KernelConfig("pallas"))
    assert [g[1] for g in _grids(lambda *a: narrow(*a), xm, ids, wts)] == [2, 2]  # I / 32 and D / 32 columns
    assert [g[1] for g in _grids(lambda *a: plain(*a), xm, ids, wts)] == [1, 1]  # the default 64
    np.testing.assert_allclose(narrow(xm, ids, wts), plain(xm, ids, wts), rtol=1e-5, atol=1e-5, err_msg=seed)


def test_the_runtime_loads_a_named_table_where_pallas_runs(tmp_path):
    from serving.runtime.config import RuntimeConfig
    from serving.runtime.moe_tuning import runtime_kernels

    path = tmp_path / "t.json"
    path.write_text(json.dumps(_doc(kind=jax.devices()[0].device_kind)))
    assert runtime_kernels(RuntimeConfig(kernel_impl="pallas", kernel_tiles=str(path)))[0].tuned == (_entry(8, NARROW),)
    assert runtime_kernels(RuntimeConfig(kernel_impl="xla", kernel_tiles=str(path)))[0].tuned == ()
    assert runtime_kernels(RuntimeConfig(kernel_impl="pallas", kernel_tiles="none"))[0].tuned == ()
    assert runtime_kernels(RuntimeConfig())[0].tuned == ()  # auto on a CPU
    with pytest.raises(ValueError, match="kernel_tiles"):
        RuntimeConfig(kernel_tiles=str(tmp_path / "missing.json"))
