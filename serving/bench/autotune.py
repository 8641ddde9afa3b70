"""`python -m serving.bench.autotune`: tune the Pallas GEMMs' tiles on this device and store the table `auto` reads.

    python -m serving.bench.autotune [--model v41-flash] [--rows 1,8,64,512,4096] [--kernels fp8_linear,moe_gmm] \
        [--budget-s 300] [--out FILE] [--smoke]

For every GEMM shape of the model in its release formats (the FP8 linears, the MXFP4 routed experts; `gemm_shapes`,
as one device's model holds them) and every row count, candidate launch shapes (block sizes that divide the weight
and hold whole scale blocks, warps, pipeline stages; searched one axis at a time from the kernel's untuned default,
`tune_one`) are run and checked against the kernel's reference on the same inputs (`serving.bench.kernels.compare`: a
candidate whose relative error exceeds `--tolerance` is rejected and never chosen); the passing ones and the XLA path
are timed (`CALLS` jitted calls queued and waited for together, medians). The entry keeps the fastest: Pallas with
its tiles, or "xla" where XLA's path is faster, with every candidate's seconds and error. The table
(`pallas_kernels.tile_table`) is rewritten after each shape, so a run cut short by `--budget-s` (checked between
candidates; the defaults and XLA are always timed) keeps what it measured. The serving runtime loads the table of its
device kind by default (`RuntimeConfig.kernel_tiles`); nothing is timed while serving.

Off a GPU the kernels run interpreted: `--smoke` (tiny shapes, few candidates) checks every candidate's output and
writes a table whose timings mean nothing (its device kind is the CPU's, which no runtime loads on a CPU).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels import fp8_linear, moe_gmm, moe_xla, tile_table
from pallas_kernels.expert_weights import QuantizedExperts
from pallas_kernels.tile_table import KernelChoice, KernelShape, Tiles
from serving.bench.kernels import _median_seconds, compare, fp8_weight, moe_weights

ROWS = (1, 8, 64, 512, 4096)
TOLERANCE = 2e-2  # relative error of a bf16 GEMM against its reference: a wrong tile is off by far more
MOE_LIMIT = 10.0
CALLS = 10  # calls queued back to back per timed run on a device, so a short kernel is not timed as its dispatch


@dataclass(frozen=True)
class GemmShape:
    """One weight shape of the model: kernel, the weight array's stored shape, format, scale block, top-k (MoE)."""

    kernel: str
    dims: tuple[int, ...]
    weights: str
    block: tuple[int, int] = (32, 32)
    top_k: int = 0

    def key(self, rows: int, dtype: str) -> KernelShape:
        return KernelShape(self.kernel, rows, self.dims, self.weights, dtype)


def gemm_shapes(config, dtype, kernels: tuple[str, ...] = tile_table.KERNELS) -> list[GemmShape]:
    """The distinct Pallas GEMM shapes of `config`'s model in its release formats, as its layers key them on one
    device."""
    from dsv41 import checkpoint, weight_formats
    from dsv41.api import abstract_params
    from dsv41.layers.basic import Linear
    from dsv41.layers.moe import Experts
    from dsv41.model import Transformer

    _, dense = abstract_params(config, dtype, True)
    formats = checkpoint.release_formats(config, list(dense))
    model = nnx.eval_shape(lambda: weight_formats.apply(Transformer(config, dtype=dtype, engram_fp8=True), formats))
    out: dict[tuple, GemmShape] = {}
    for _, m in nnx.iter_modules(model):
        if isinstance(m, Linear) and m.scale is not None and "fp8_linear" in kernels:
            shape = tuple(m.weight.get_value().shape)
            g = GemmShape("fp8_linear", shape, f"fp8 {m.block[0]}x{m.block[1]}", m.block)
        elif isinstance(m, Experts) and m.weight_kind is not None and "moe_gmm" in kernels:
            shape = tuple(m.w1.get_value().shape)
            g = GemmShape("moe_gmm", shape, m.weight_kind, top_k=config.num_experts_per_tok)
        else:
            continue
        if g.kernel == "fp8_linear" and fp8_linear.tiles_for(*g.dims, g.block) is None:
            continue  # no whole-block tile: always the xla path
        out.setdefault((g.kernel, g.dims, g.weights), g)
    return list(out.values())


def smoke_shapes() -> list[GemmShape]:
    """Interpret-mode sizes: one FP8 linear, one MXFP4 expert stack [E=8, I=64, D=128] (packed D / 2)."""
    return [GemmShape("fp8_linear", (128, 64), "fp8 32x32"), GemmShape("moe_gmm", (8, 64, 64), "mxfp4", top_k=2)]


def axes(rows: int, smoke: bool) -> dict[str, tuple]:
    """The values each launch parameter is searched over (`tune_one`: one axis at a time from the default)."""
    if smoke:
        return {"block_n": (32, 64), "block_k": (32, 64)}
    return {"block_n": (32, 64, 128), "block_k": (64, 128, 256),
            "block_m": (None, 16, 32, 64, 128) if rows > 16 else (None, 16), "num_warps": (4, 8),
            "num_stages": (2, 3, 4)}


def _effective(g: GemmShape, t: Tiles) -> tuple | None:
    """The tiles the kernel would really use with `t` (it shrinks blocks to divide the weight), or None where it
    cannot run `t`."""
    if g.kernel == "fp8_linear":
        return fp8_linear.tiles_for(*g.dims, g.block, t.block_n, t.block_k)
    E, D, I = _moe_dims(g)
    w13, w2 = _expert_structs(g.weights, E, I, D), _expert_structs(g.weights, E, D, I)
    try:
        return moe_gmm.tiles_for(w13, w13, w2, t.block_n, t.block_k)
    except ValueError:
        return None


def _expert_structs(kind: str, E: int, O: int, In: int):
    """An expert stack's shapes as `moe_gmm` takes it: MXFP4 packed bytes + scales, or a float array."""
    if kind == "mxfp4":
        return QuantizedExperts(jax.ShapeDtypeStruct((E, O, In // 2), jnp.uint8),
                                jax.ShapeDtypeStruct((E, O, In // 32), jnp.uint8), "mxfp4")
    return jax.ShapeDtypeStruct((E, O, In), jnp.dtype(kind))


def _moe_dims(g: GemmShape) -> tuple[int, int, int]:
    """(E, D, I) of a moe_gmm shape (its w1 as stored: [E, I, D], MXFP4 [E, I, D / 2])."""
    E, I, D = g.dims
    return E, D * (2 if g.weights == "mxfp4" else 1), I


def inputs(g: GemmShape, rows: int, dtype, seed: int = 0) -> tuple:
    """Random operands of one call (`serving.bench.kernels`' weights: outputs of order one) and rows."""
    rng = np.random.default_rng(seed)
    key = jax.random.key(seed)
    if g.kernel == "fp8_linear":
        return (jnp.asarray(rng.standard_normal((rows, g.dims[1])), dtype), *fp8_weight(key, *g.dims, g.block))
    E, D, _ = _moe_dims(g)
    ids = np.argsort(rng.random((rows, E)), axis=1)[:, :g.top_k].astype(np.int32)
    wts = rng.uniform(0.5, 1.0, (rows, g.top_k))
    x = jnp.asarray(rng.standard_normal((rows, D)), dtype)
    return (x, jnp.asarray(ids), jnp.asarray(wts / wts.sum(1, keepdims=True), jnp.float32),
            *moe_weights(key, *_moe_dims(g), g.weights))


def paths(g: GemmShape, dtype) -> tuple[Callable[[Tiles], Callable], Callable, Callable]:
    """(tiles -> the Pallas call, the XLA path, the reference) of `g`'s kernel on `inputs`' operands."""
    if g.kernel == "fp8_linear":
        kw = dict(block=g.block, dtype=dtype, out_dtype=dtype)
        return ((lambda t: lambda *a: fp8_linear.pallas(*a, **kw, **t.kwargs())),
                lambda *a: fp8_linear.xla(*a, **kw), lambda *a: fp8_linear.reference(*a, **kw))
    kw = dict(limit=MOE_LIMIT)
    return ((lambda t: lambda *a: moe_gmm.pallas(*a, **kw, **t.kwargs())),
            lambda *a: moe_xla.xla(*a, **kw), lambda *a: moe_gmm.reference(*a, **kw))


def tune_one(g: GemmShape, rows: int, dtype, *, smoke: bool, reps: int, tolerance: float, deadline: float,
             kernel_for: Callable[[Tiles], Callable] | None = None) -> dict:
    """One table entry. From the kernel's default launch shape, each axis in turn (`axes`) is tried with the others
    at the best so far (coordinate descent: tens of candidates, not the grid's hundreds); each candidate's output is
    checked against the reference and only passing ones are timed and can win; the search stops at `deadline`
    (after the default). The fastest passing candidate is chosen, or the XLA path where it is faster.
    `kernel_for` replaces the Pallas call (tests)."""
    args = inputs(g, rows, dtype)
    calls = 1 if smoke else CALLS
    pallas_for, xla, ref = paths(g, dtype)
    kernel_for = kernel_for or pallas_for
    want = jax.jit(ref)(*args)
    xla_s = _median_seconds(jax.jit(xla), args, reps, calls)
    tried: dict[tuple, dict] = {}

    def measure(t: Tiles) -> dict | None:
        """The candidate's row (None: a shape the kernel cannot take); one run per distinct program."""
        shape = _effective(g, t)
        if shape is None:
            return None
        key = (shape, t.block_m, t.num_warps, t.num_stages)
        if key in tried:
            return tried[key]
        row = tried[key] = {"tiles": t._asdict()}
        fn = jax.jit(kernel_for(t))
        try:
            row.update(compare(fn(*args), want))
        except Exception as e:  # a launch shape the compiler refuses (registers, shared memory)
            row["error"] = f"{type(e).__name__}: {e}"[:300]
            return row
        row["ok"] = row["rel_err_vs_check"] <= tolerance
        if row["ok"]:
            row["seconds"] = _median_seconds(fn, args, reps, calls)
        return row

    best, best_row = Tiles(), measure(Tiles())
    default_row = best_row
    for axis, v in ((axis, v) for axis, values in axes(rows, smoke).items() for v in values):
        if time.monotonic() > deadline:
            break
        t = best._replace(**{axis: v})
        row = measure(t)
        if row and row.get("ok") and (not (best_row or {}).get("ok") or row["seconds"] < best_row["seconds"]):
            best, best_row = t, row
    rows_tried = list(tried.values())
    won = best_row if best_row and best_row.get("ok") else None
    choice = KernelChoice("pallas", best) if won and won["seconds"] < xla_s else KernelChoice("xla")
    return {"shape": {**g.key(rows, jnp.dtype(dtype).name)._asdict(), "dims": list(g.dims)},
            "choice": {"impl": choice.impl, "tiles": choice.tiles._asdict()},
            "xla_s": xla_s, "pallas_s": won["seconds"] if won else None,
            "default_pallas_s": (default_row or {}).get("seconds"),
            "candidates": len(rows_tried), "rejected": sum(1 for r in rows_tried if not r.get("ok")),
            "tried": rows_tried}


def run(shapes: list[GemmShape], rows: tuple[int, ...], dtype, *, smoke: bool, reps: int, tolerance: float,
        budget_s: float, out: Path | None, kernel_for=None) -> dict:
    """Every shape at every row count (each shape's share of the budget), the table written after each entry. The
    entries of a table already at `out` for this device kind stay where this run tunes other shapes (another model,
    other row counts), and give way where it tunes the same ones."""
    device = jax.devices()[0]
    meta = {"backend": jax.default_backend(), "jax": jax.__version__, "dtype": jnp.dtype(dtype).name,
            "interpreted": jax.default_backend() != "gpu", "tolerance": tolerance, "budget_s": budget_s}
    start, entries = time.monotonic(), []
    tuned_now = {g.key(r, jnp.dtype(dtype).name) for g in shapes for r in rows}
    kept = [e for e in _stored_entries(out, device.device_kind)
            if tile_table.KernelShape(**{**e["shape"], "dims": tuple(e["shape"]["dims"])}) not in tuned_now]
    jobs = [(g, r) for g in shapes for r in rows]
    for n, (g, r) in enumerate(jobs):
        deadline = start + budget_s * (n + 1) / len(jobs)
        entry = tune_one(g, r, dtype, smoke=smoke, reps=reps, tolerance=tolerance, deadline=deadline,
                         kernel_for=kernel_for)
        entries.append(entry)
        print(f"{g.kernel:10s} {str(g.dims):20s} {g.weights:10s} rows {r:5d}: {entry['choice']['impl']:6s} "
              f"xla {entry['xla_s'] * 1e6:9.1f} us, best pallas "
              + (f"{entry['pallas_s'] * 1e6:9.1f} us" if entry["pallas_s"] else "      n/a")
              + f" ({entry['candidates']} tried, {entry['rejected']} rejected)", flush=True)
        doc = tile_table.to_json(device.device_kind, kept + entries, meta)
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(doc, indent=1))
    return tile_table.to_json(device.device_kind, kept + entries, {**meta, "seconds": time.monotonic() - start})


def _stored_entries(out: Path | None, device_kind: str) -> list[dict]:
    """The entries of the table at `out` when it is one of this device kind (checked by `tile_table.read`)."""
    if out is None or not out.exists():
        return []
    tile_table.read(out, device_kind)  # a table of another kind or a bad one: refused here, naming the file
    return json.loads(out.read_text())["entries"]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m serving.bench.autotune", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="v41-flash", help="a preset or checkpoint folder whose GEMM shapes are tuned")
    p.add_argument("--rows", default=",".join(map(str, ROWS)))
    p.add_argument("--kernels", default=",".join(tile_table.KERNELS))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--budget-s", type=float, default=300.0, help="seconds for the whole run (checked between "
                                                                  "candidates)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--tolerance", type=float, default=TOLERANCE)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, few candidates (interpret mode on a CPU)")
    p.add_argument("--out", type=Path, default=None,
                   help="the table (default: pallas_kernels/tuned/<device kind>.json on a GPU; none elsewhere)")
    args = p.parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    kernels = tuple(k for k in args.kernels.split(",") if k)
    bad = [k for k in kernels if k not in tile_table.KERNELS]
    if bad:
        p.error(f"--kernels: {bad} not among {tile_table.KERNELS}")
    if args.smoke:
        shapes = [g for g in smoke_shapes() if g.kernel in kernels]
    else:
        import dsv41

        shapes = gemm_shapes(dsv41.load_config(args.model), dtype, kernels)
    out = args.out
    if out is None and jax.default_backend() == "gpu" and not args.smoke:
        out = tile_table.table_path(jax.devices()[0].device_kind)
    rows = tuple(int(r) for r in args.rows.split(","))
    doc = run(shapes, rows, dtype, smoke=args.smoke, reps=args.reps, tolerance=args.tolerance,
              budget_s=args.budget_s, out=out)
    print(f"{len(doc['entries'])} entries in {doc['seconds']:.0f} s" + (f" -> {out}" if out else ""))
    return doc


if __name__ == "__main__":
    main()
