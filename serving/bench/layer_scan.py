"""`python -m serving.bench.layer_scan`: what one compiled body per layer structure would cost and save on this
backend - G layers of one structure run three ways, compile time and step time side by side.

  unrolled  the segments' form: one program, the G layers inlined one after the other (G layer bodies).
  scanned   one program, `lax.scan` over the G layers' parameters stacked on a leading axis (one layer body).
  per-layer one compiled layer, called G times from the host (one body, G dispatches; vLLM's piecewise form).

Each layer is a real V4.1 block (`--layer` of `--model`, default: `small`'s decoder reader 7) with G distinct
weight copies: mHC, the attention projections (queries, KV, grouped output) with the attention core left out
(it reads the cache, not weights), and the MoE. The layers enter with a pending FFN output, as every layer
after the first does. Times: compile = lower + XLA compile (per-layer: its first call, which also runs the G
layers once); step = median of `--repeats` runs, the variants alternating run by run. All three must give the same
bits (checked). `sliced MB` is what the scanned program's loop copies out of the stacked parameters per layer (its
dynamic slices along the layer axis, from the compiled HLO): XLA:CPU feeds a dot or gather from a contiguous
buffer, so each iteration copies its layer's weights first. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import dsv41
from dsv41.block import Streams, attention_input, ffn_and_output
from dsv41.layers.rope import inv_freq, rope_angles
from serving.bench.hlo_text import hlo_array_bytes
from serving.runtime.host_memory import keep_freed_memory_or_say

VARIANTS = ("unrolled", "scanned", "per-layer")


def _scaled(a: jax.Array, g: int) -> jax.Array:
    return (a * (1 + g / 100)).astype(a.dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a


class LayerStack:
    """G copies of one block's parameters (copy g scaled by 1 + g/100), per layer and stacked."""

    def __init__(self, model: dsv41.Model, layer: int, G: int):
        self.c = model.config
        block = model.module.layers[layer]
        self.graphdef, state = nnx.split(block)
        leaves, self.treedef = jax.tree.flatten(state)
        self.per_layer = [[_scaled(a, g) for a in leaves] for g in range(G)]
        self.stacked = [jnp.stack([p[i] for p in self.per_layer]) for i in range(len(leaves))]
        self.layer_bytes = sum(a.nbytes for a in leaves)
        self.step = jax.jit(self._one)

    def _one(self, leaves, s: Streams, pos_T, ids_T) -> Streams:
        """One block over the rows: its weight-reading work, the attention core replaced by its queries."""
        b = nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, leaves))
        R, mix, x = attention_input(b, self.c, s)
        cos, sin = rope_angles(pos_T, inv_freq(self.c, b.role.rope))
        _, q = b.attn.queries(x)
        kv = b.attn.project_kv(x, cos, sin, False)
        y = b.attn.project_out(q, x.dtype) + (jnp.mean(kv.astype(jnp.float32)) * 1e-3).astype(x.dtype)
        s, _ = ffn_and_output(b, self.c, R, mix, y, ids_T)
        return s

    def entry(self, leaves, R_TnD, y_TD) -> Streams:
        """Streams as a layer after the first meets them: the previous FFN's output pending."""
        b = nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, leaves))
        mix = b.hc_ffn(R_TnD)
        return Streams(R_TnD, mix.pre, (mix, y_TD))

    def unrolled(self, per_layer, R, y, pos_T, ids_T):
        s = self.entry(per_layer[0], R, y)
        for leaves in per_layer:
            s = self._one(leaves, s, pos_T, ids_T)
        return s.R

    def scanned(self, stacked, R, y, pos_T, ids_T):
        s = self.entry([a[0] for a in stacked], R, y)
        s, _ = jax.lax.scan(lambda s, leaves: (self._one(leaves, s, pos_T, ids_T), None), s, stacked)
        return s.R


def _inputs(c, T: int):
    rng = np.random.default_rng(T)
    R = jnp.asarray(rng.standard_normal((T, c.hc_mult, c.hidden_size)), jnp.bfloat16)
    y = jnp.asarray(rng.standard_normal((T, c.hidden_size)), jnp.bfloat16)
    return R, y, jnp.arange(T, dtype=jnp.int32), jnp.asarray(rng.integers(0, c.vocab_size, T), jnp.int32)


def layer_axis_slice_bytes(hlo_text: str) -> int:
    """Bytes of the dynamic slices along a leading layer axis in a compiled program's text (one iteration's)."""
    slices = re.findall(r"= (\w+)\[([\d,]+)\]\{[\d,]*\} dynamic-slice\(", hlo_text)
    return sum(hlo_array_bytes(dtype, dims) for dtype, dims in slices if dims.startswith("1,"))


def measure(stack: LayerStack, T: int, repeats: int) -> dict:
    """{variant: {compile_s, step_ms}} for T rows, plus the bit check and the scanned loop's sliced bytes."""
    R, y, pos, ids = _inputs(stack.c, T)
    runs, out = {}, {}
    for name, fn, params in (("unrolled", stack.unrolled, stack.per_layer), ("scanned", stack.scanned, stack.stacked)):
        t0 = time.perf_counter()
        exe = jax.jit(fn).lower(params, R, y, pos, ids).compile()
        out[name] = {"compile_s": time.perf_counter() - t0}
        runs[name] = functools.partial(exe, params, R, y, pos, ids)
    scanned_hlo = exe.as_text()
    t0 = time.perf_counter()  # the per-layer form compiles its entry and its one layer in its first call
    entry = jax.jit(stack.entry)

    def per_layer():
        s = entry(stack.per_layer[0], R, y)
        for leaves in stack.per_layer:
            s = stack.step(leaves, s, pos, ids)
        return s.R

    first = per_layer().block_until_ready()
    out["per-layer"] = {"compile_s": time.perf_counter() - t0}
    runs["per-layer"] = per_layer
    results = {name: run().block_until_ready() for name, run in runs.items()}
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            t = time.perf_counter()
            run().block_until_ready()
            times[name].append(time.perf_counter() - t)
    ref = np.asarray(results["unrolled"].astype(jnp.float32))
    for name in runs:
        out[name]["step_ms"] = statistics.median(times[name]) * 1e3
        out[name]["same_bits"] = bool(np.array_equal(np.asarray(results[name].astype(jnp.float32)), ref))
    out["per-layer"]["same_bits"] &= bool(np.array_equal(np.asarray(first.astype(jnp.float32)), ref))
    out["scanned"]["sliced_mb_per_layer"] = layer_axis_slice_bytes(scanned_hlo) / 1e6
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m serving.bench.layer_scan", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small", help="preset (random weights, bfloat16)")
    ap.add_argument("--layer", type=int, default=7, help="the block whose structure the G layers share")
    ap.add_argument("--layers", default="2,4,8,16", help="G values")
    ap.add_argument("--tokens", default="8,512", help="rows per step (decode batch, prefill chunk)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default="bench_layer_scan.json")
    args = ap.parse_args(argv)
    keep_freed_memory_or_say()
    model = dsv41.random_model(args.model, dtype="bfloat16")
    rows, failures = [], []
    print(f"{args.model} layer {args.layer}: {model.config.roles[args.layer]}")
    print("| G | rows | unrolled compile s | scanned | per-layer | unrolled step ms | scanned | per-layer "
          "| scanned / unrolled step | scanned sliced MB per layer (of its weights) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for G in (int(g) for g in args.layers.split(",")):
        stack = LayerStack(model, args.layer, G)
        for T in (int(t) for t in args.tokens.split(",")):
            m = measure(stack, T, args.repeats)
            rows.append({"layers": G, "rows": T, "layer_mb": stack.layer_bytes / 1e6, **m})
            failures += [f"G={G} T={T} {v}" for v in VARIANTS if not m[v]["same_bits"]]
            u, s, p = (m[v] for v in VARIANTS)
            print(f"| {G} | {T} | {u['compile_s']:.2f} | {s['compile_s']:.2f} | {p['compile_s']:.2f} "
                  f"| {u['step_ms']:.2f} | {s['step_ms']:.2f} | {p['step_ms']:.2f} "
                  f"| {s['step_ms'] / u['step_ms']:.2f} | {s['sliced_mb_per_layer']:.1f} "
                  f"(of {stack.layer_bytes / 1e6:.1f}) |", flush=True)
        del stack
    result = {"model": args.model, "layer": args.layer, "backend": jax.default_backend(),
              "device": str(jax.devices()[0].device_kind), "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    if failures:
        raise SystemExit(f"the variants disagree: {', '.join(failures)}")


if __name__ == "__main__":
    main()
