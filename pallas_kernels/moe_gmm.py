"""Routed experts of the V4.1 MoE FFN (spec §2.8) as a grouped matmul over expert-sorted rows:

  y[t] = sum_j w[t, j] * W2_e (silu(min(W1_e x_t, L)) * clamp(W3_e x_t, -L, L)),   e = ids[t, j]

Inputs: x_TD [T, D]; ids_TK [T, k] expert ids and weights_TK [T, k] (the router's outputs); w1, w3
[E, I, D] (gate, up) and w2 [E, D, I] (down) in the model's `Experts` layout, each a float array or a
`QuantizedExperts` (MXFP4 / FP8 records, see expert_weights). An id outside [0, E) contributes nothing
(padding tokens; an expert-parallel shard passes ids minus its first expert). Output float32 [T, D] (or
`out_dtype`).

Numerics follow the model: matmuls in the compute dtype (the float weights' dtype; x's dtype for quantized
weights, whose decoded values are exact in bf16) with float32 accumulation, SwiGLU in float32, the combine
weight applied to h before the down projection (h rounded to the compute dtype), the k contributions
summed in float32.

Grouped layout (pallas and the XLA tile form): the T*k (token, slot) pairs are ordered by expert with one
argsort of T*k keys, each expert's group is padded to a multiple of `tile` rows so that every tile belongs to
one expert, and the static row count is T*k + min(E, T*k) * (tile - 1) rounded up to a tile. Tiles past the
last group are skipped. Each output row is gathered back from its k rows (no scatter-add over D). The XLA
path's batched form (float weights on CPU) gives every expert a fixed number of rows instead (see `xla`).
"""

from __future__ import annotations

import functools
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.common import product_precision
from pallas_kernels.dispatch import interpret_default, resolve_impl
from pallas_kernels.expert_weights import QuantizedExperts, check_experts, decode_tile, reference_dequantize

MIN_DOT = 16  # Triton's smallest dot dimension


def _check(x_TD, ids_TK, weights_TK, w1, w3, w2):
    if x_TD.ndim != 2:
        raise ValueError(f"x_TD: expected [T, D], got {x_TD.shape}")
    T, D = x_TD.shape
    if ids_TK.ndim != 2 or ids_TK.shape[0] != T or not jnp.issubdtype(ids_TK.dtype, jnp.integer):
        raise ValueError(f"ids_TK: expected integer [{T}, k], got {ids_TK.dtype} {ids_TK.shape}")
    if weights_TK.shape != ids_TK.shape:
        raise ValueError(f"weights_TK: expected {ids_TK.shape} like ids_TK, got {weights_TK.shape}")
    if len(w1.shape) != 3:
        raise ValueError(f"w1: expected [E, I, D], got {w1.shape}")
    E, I = w1.shape[:2]
    check_experts(w1, "w1", (E, I, D))
    check_experts(w3, "w3", (E, I, D))
    check_experts(w2, "w2", (E, D, I))


def _compute_dtype(x_TD, w1) -> jnp.dtype:
    return jnp.dtype(x_TD.dtype if isinstance(w1, QuantizedExperts) else w1.dtype)


def _swiglu(gate, up, limit: float):
    """silu(min(gate, limit)) * clamp(up, -limit, limit), float32."""
    g = jnp.minimum(gate, limit)
    return g * jax.nn.sigmoid(g) * jnp.clip(up, -limit, limit)


# ================================================================================ reference
def reference(x_TD, ids_TK, weights_TK, w1, w3, w2, *, limit: float, out_dtype=jnp.float32):
    """Dense over each (token, slot): the selected experts' weights gathered per pair, float32 sums."""
    _check(x_TD, ids_TK, weights_TK, w1, w3, w2)
    E = w1.shape[0]
    cdt = _compute_dtype(x_TD, w1)
    prec = product_precision(cdt)
    ok = (ids_TK >= 0) & (ids_TK < E)
    e = jnp.where(ok, ids_TK, 0)
    W1, W3, W2 = (reference_dequantize(w).astype(cdt) if isinstance(w, QuantizedExperts) else w for w in (w1, w3, w2))
    x = x_TD.astype(cdt)
    mm = functools.partial(jnp.einsum, preferred_element_type=jnp.float32, precision=prec)
    h = _swiglu(mm("td,tkid->tki", x, W1[e]), mm("td,tkid->tki", x, W3[e]), limit)
    h = (h * jnp.where(ok, weights_TK.astype(jnp.float32), 0.0)[..., None]).astype(cdt)
    return jnp.sum(mm("tki,tkdi->tkd", h, W2[e]), axis=1).astype(out_dtype)


# ============================================================================ group layout
class GroupLayout(NamedTuple):
    row_pair: jax.Array  # [Np] pair (t * k + j) on each expert-sorted row; T*k on padding rows
    pair_row: jax.Array  # [T*k] row of each pair; Np for pairs whose id is outside [0, E)
    tile_expert: jax.Array  # [Np / tile] expert of each tile (clamped to E - 1 past the last group)
    n_tiles: jax.Array  # [1] int32: tiles holding rows (a prefix of the tiles)


def padded_rows(n_pairs: int, n_experts: int, tile: int) -> int:
    """Static bound on the expert-sorted rows: every non-empty group wastes at most tile - 1 rows."""
    n = n_pairs + min(n_experts, n_pairs) * (tile - 1)
    return -(-n // tile) * tile


def _expert_order(ids_TK: jax.Array, n_experts: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The pairs by expert: (key [T*k]: the pair's expert, E where dropped; order [T*k]: pairs sorted by key,
    stable; counts [E]; start [E]: each expert's first place in that order). One sort of T*k keys."""
    flat = ids_TK.reshape(-1).astype(jnp.int32)
    key = jnp.where((flat >= 0) & (flat < n_experts), flat, n_experts)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    counts = jnp.zeros(n_experts + 1, jnp.int32).at[key].add(1)[:n_experts]
    return key, order, counts, jnp.cumsum(counts) - counts


def _with_zero_row(x_TD, weights_TK, cdt) -> tuple[jax.Array, jax.Array]:
    """x [T + 1, D] in `cdt` and the combine weights flat [T*k + 1] float32, each with a zero row last: what
    padding places and dropped pairs read (pair T*k, token T)."""
    x = jnp.concatenate([x_TD.astype(cdt), jnp.zeros((1, x_TD.shape[1]), cdt)])
    return x, jnp.concatenate([weights_TK.reshape(-1).astype(jnp.float32), jnp.zeros((1,), jnp.float32)])


def group_layout(ids_TK: jax.Array, n_experts: int, tile: int) -> GroupLayout:
    """Expert-sorted, tile-padded placement of the (token, slot) pairs; one sort of T*k keys."""
    P, E = ids_TK.size, n_experts
    Np = padded_rows(P, E, tile)
    key, order, counts, start = _expert_order(ids_TK, E)
    sorted_key = key[order]
    padded = (counts + tile - 1) // tile * tile
    padded_end = jnp.cumsum(padded)
    padded_start = padded_end - padded
    e = jnp.minimum(sorted_key, E - 1)
    row = jnp.where(sorted_key < E, padded_start[e] + jnp.arange(P, dtype=jnp.int32) - start[e], Np)
    row_pair = jnp.full(Np, P, jnp.int32).at[row].set(order, mode="drop", indices_are_sorted=True)
    pair_row = jnp.zeros(P, jnp.int32).at[order].set(row)
    tiles = jnp.arange(Np // tile, dtype=jnp.int32) * tile
    tile_expert = jnp.minimum(jnp.searchsorted(padded_end, tiles, side="right"), E - 1).astype(jnp.int32)
    return GroupLayout(row_pair, pair_row, tile_expert, (padded_end[-1] // tile).reshape(1))


def _sorted_rows(x_TD, weights_TK, layout: GroupLayout):
    """x rows [Np, D] and combine weights [Np] in expert-sorted order (zeros on padding rows)."""
    x, w = _with_zero_row(x_TD, weights_TK, x_TD.dtype)
    return x[layout.row_pair // weights_TK.shape[1]], w[layout.row_pair]


def _pair_rows(y_ND, layout: GroupLayout) -> jax.Array:
    """Every pair's row of the expert-sorted output [T*k, D] float32; dropped pairs read an appended zero row."""
    return jnp.concatenate([y_ND.astype(jnp.float32), jnp.zeros((1, y_ND.shape[1]), jnp.float32)])[layout.pair_row]


def _combine(y_ND, layout: GroupLayout, T: int, k: int, out_dtype):
    """out[t] = sum_j y[row of (t, j)], float32."""
    return jnp.sum(_pair_rows(y_ND, layout).reshape(T, k, -1), axis=1).astype(out_dtype)


# ===================================================================================== xla
def rows_per_tile(n_pairs: int, n_experts: int, lo: int, hi: int) -> int:
    """The power of two nearest below the mean rows per expert, within [lo, hi] (the Pallas path's block rows)."""
    per_expert = max(1, n_pairs // n_experts)
    return min(hi, max(lo, 1 << (per_expert.bit_length() - 1)))


def xla_tile(n_pairs: int, n_experts: int) -> int:
    """The XLA path's rows per tile: the power of two at or above the mean rows per expert, within [2, 256] (most
    experts' rows in one scan step; XLA:CPU's per-step cost outweighs the padding). Not 1: a one-row tile is a
    matrix-vector product, which XLA:CPU sums in another order than the same rows in a wider tile."""
    per_expert = max(1, -(-n_pairs // n_experts))
    return min(256, max(2, 1 << (per_expert - 1).bit_length()))


TILES_PER_STEP = 4  # the tile form's row tiles per loop step (see `xla`)


# The widest expert blocks (batched capacity, rows per expert) of a "small step" (decode), whose form is `xla`'s
# `small_steps`: where the rows are few, the batched form may put the weights on the left of its products
# (h = W x^T per expert), tiles may beat it, and which wins is the CPU's (see `xla`).
SMALL_STEP_MAX_ROWS = 32


def batch_capacity(n_pairs: int, n_experts: int) -> int:
    """The batched form's rows per expert: 1.5 x the mean rows per expert, rounded up to a multiple of 8, at least 8,
    so that a balanced routing needs no tail (512 tokens x top-6 at random over 64 experts: mean 48, max 65,
    capacity 72)."""
    return max(8, -(-3 * n_pairs // (2 * n_experts * 8)) * 8)


def xla(x_TD, ids_TK, weights_TK, w1, w3, w2, *, limit: float, out_dtype=jnp.float32, capacity: int | None = None,
        tile: int | None = None, tiles_per_step: int = TILES_PER_STEP, small_steps: str = "rule"):
    """CPU path, no ragged_dot (XLA:CPU's costs about E dense matmuls, jax-notes §4.3), in one of three forms:

    - batched (float weights; `capacity` forces it): every expert's first `capacity` rows (default
      `batch_capacity`), in expert-sorted order, as x [E, capacity, D], multiplied by the weights in place (on
      the right of the products; on the left in the "batched_left" small-step form): three GEMMs batched over the
      experts, which XLA:CPU runs on its fast (YNNPACK, AMX) path, where the tile form's many small GEMMs cost
      ~0.1-0.2 ms each whatever their size. The rows past `capacity` of the experts that hold more (an
      unbalanced routing: the peer checkpoint's random router gives one expert 400-480 of 512 tokens) go through
      the tile form in tiles of `capacity` rows, skipped when there are none. Not for quantized weights: they
      would all be decoded each call.
    - tiles (quantized weights; `tile` forces it): a loop over steps of `tiles_per_step` row tiles of one
      expert each (only the steps holding rows run), the step's tiles as one batched matmul over their gathered,
      decoded experts: the rows actually routed plus at most tile - 1 padding rows per expert, decoding only the
      experts the routing touches. Default tile (`xla_tile`): the mean rows per expert rounded up to a power of two.
    - per pair: a step whose (token, choice) pairs' decoded weights fit GATHER_BYTES (a decode step of a few
      rows of a small model) gathers each pair's expert: three batched matrix-vector products; its trailing
      padding rows (ids dropped) are skipped (`_per_pair`).

    Steps of few rows per expert (float weights, a batched capacity <= SMALL_STEP_MAX_ROWS: decode steps) take
    the form `small_steps` names: "rule" (batched), one of SMALL_STEP_FORMS, or "tune" (the serving runtime's
    default): the fastest on this machine of the forms that give the rule's bits here (`tuned_small_step_form`).
    Which wins is the CPU's: at 8 tokens of the peer shape in bf16, ms per layer, left / right / tiles: 1.6 /
    2.3-2.5 / 2.8 on a 2-core AMX Xeon, 3.8 / 2.6 / 1.5 on a 2-core AVX512-BF16 EPYC (no AMX), whose bf16 product
    [64, 128, 512] x [64, 512, 8] alone took 1.15 ms with the weights left and 0.41 ms right. On that EPYC the
    weights-left products sum in another order (1 ulp of float32 apart), on the AMX Xeon they gave the same bits.

    Every form multiplies each row alone and sums a token's k rows in slot order, so they agree to the bit
    wherever XLA:CPU's dots sum a row the same way (measured here: bf16 and float32, the peer shape, 0 difference
    between the batched and tile forms).

    Measured on the peer V4's MoE (64 experts of 128 x 512, top-6, this CPU, weights as arguments), ms per layer:
    - bf16 experts, random routing, batched vs tiles: 8 / 32 / 128 / 512 / 2,048 tokens 1.5 / 1.7 / 2.5 / 5.1 /
      31 vs 2.8 / 5.3 / 6.3 / 13.5 / 51; float32 at 8 / 32 / 512: 3.9 / 4.4 / 12.4 vs 4.7 / 8.7 / 26.1. The
      peer model's own routing at 512 tokens (max 398-481 rows an expert): 9.4-10.8 vs 12.6-15.3; a balanced one
      4.9 vs 10.6-12.9.
    - MXFP4 experts, tiles, float32, one tile per step: 128 tokens 30.1 / 17.5 / 23.3 at tile 8 / 16 / 32; 512
      tokens 46.0 / 28.1 / 58.3 at 32 / 64 / 128; 8 tokens 4.6 / 4.9 / 5.1-7.4 at 2 / 4 / 8. Four tiles per
      step instead of one: 512-token prefill of the peer model 0.355 -> 0.337 s, batch-8 decode 27.6 -> 22.1 ms.
    - per pair (MXFP4, float32): 1 / 2 / 3 tokens 0.91 / 1.82 / 2.71 ms vs tiles 1.78 / 3.06 / 3.92 ms; at 8
      tokens (38 MB gathered) 21.6 vs 7.9 ms, hence the bound."""
    _check(x_TD, ids_TK, weights_TK, w1, w3, w2)
    if small_steps not in SMALL_STEPS:
        raise ValueError(f"small_steps must be one of {SMALL_STEPS}, got {small_steps!r}")
    T, D = x_TD.shape
    k, (E, I) = ids_TK.shape[1], w1.shape[:2]
    cdt = _compute_dtype(x_TD, w1)
    forced = capacity is not None or tile is not None
    if not forced and ids_TK.size * 3 * I * D * 4 <= GATHER_BYTES:
        return _per_pair(x_TD, ids_TK, weights_TK, w1, w3, w2, limit, out_dtype, cdt)
    C = capacity or batch_capacity(ids_TK.size, E)
    form = "tiles" if tile is not None or (capacity is None and isinstance(w1, QuantizedExperts)) else "batched_right"
    if form == "batched_right" and C <= SMALL_STEP_MAX_ROWS and small_steps != "rule":
        form = tuned_small_step_form(T, k, E, I, D, cdt) if small_steps == "tune" else small_steps
    if form == "tiles":
        y_PD = _tile_rows(x_TD, ids_TK, weights_TK, w1, w3, w2, limit, cdt, tile or xla_tile(ids_TK.size, E),
                          tiles_per_step)
    else:
        y_PD = _batched_then_tiles(x_TD, ids_TK, weights_TK, w1, w3, w2, limit, cdt, C, tiles_per_step,
                                   weights_left=form == "batched_left")
    return _sum_slots(y_PD, T, k, out_dtype)


SMALL_STEP_FORMS = ("batched_left", "batched_right", "tiles")
SMALL_STEPS = ("rule", "tune", *SMALL_STEP_FORMS)


_tuning_file: Path | None = None  # where tuned forms persist across processes (None: this process only)


def set_tuning_file(path: str | Path | None) -> None:
    """Keep `tuned_small_step_form`'s choices in this JSON file (the serving runtime puts it beside its compiled
    programs), so a restart on the same machine and versions times nothing."""
    global _tuning_file
    _tuning_file = Path(path) if path else None


@functools.cache
def tuned_small_step_form(T: int, k: int, E: int, I: int, D: int, dtype: jnp.dtype) -> str:
    """The fastest form on this machine for a T-row step of this MoE shape (float experts in `dtype`, a uniform random
    routing) among SMALL_STEP_FORMS that give the rule's (batched, weights right) bits here on random inputs, so the
    choice never moves a result: each compiled alone (~1 s each), then 7 rounds of one run of each, medians. Once per
    process, and once per machine where a tuning file is set. Runs where a program is traced (a bucket's first
    compile), eagerly."""
    key = repr((T, k, E, I, D, str(dtype), jax.__version__, jaxlib.__version__, jax.devices()[0].device_kind,
                platform.machine(), _cpu_model()))
    stored = _read_tuning()
    if stored.get(key) in SMALL_STEP_FORMS:
        return stored[key]
    with jax.ensure_compile_time_eval():
        kx, kw, k1, k3, k2 = jax.random.split(jax.random.key(0), 5)
        x = jax.random.normal(kx, (T, D), dtype)
        ids = jnp.argsort(jax.random.uniform(kw, (T, E)), axis=1)[:, :k].astype(jnp.int32)
        w = jnp.full((T, k), 1.0 / k, jnp.float32)
        w1, w3 = (jax.random.normal(kk, (E, I, D), dtype) / D ** 0.5 for kk in (k1, k3))
        w2 = jax.random.normal(k2, (E, D, I), dtype) / I ** 0.5
        args = (x, ids, w, w1, w3, w2)
        runs = {form: jax.jit(functools.partial(xla, limit=10.0, small_steps=form)) for form in SMALL_STEP_FORMS}
        outs = {form: jax.device_get(run(*args)) for form, run in runs.items()}  # also each form's warm-up
        runs = {form: run for form, run in runs.items() if np.array_equal(outs[form], outs["batched_right"])}
        seconds: dict[str, list[float]] = {form: [] for form in runs}
        for _ in range(7):
            for form, run in runs.items():
                t = time.perf_counter()
                run(*args).block_until_ready()
                seconds[form].append(time.perf_counter() - t)
    best = min(seconds, key=lambda form: float(np.median(seconds[form])))
    if _tuning_file is not None:
        _tuning_file.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=_tuning_file.parent, delete=False, suffix=".tmp") as f:
            json.dump({**_read_tuning(), key: best}, f, indent=0)
        os.replace(f.name, _tuning_file)
    return best


def _read_tuning() -> dict:
    try:
        return json.loads(_tuning_file.read_text()) if _tuning_file is not None else {}
    except (OSError, ValueError):  # absent or torn: tune again
        return {}


@functools.cache
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        return ""


def _sum_slots(y_PD, T: int, k: int, out_dtype) -> jax.Array:
    """out[t] = sum_j y[t * k + j] in slot order, float32, materialized: XLA:CPU would otherwise fuse the sum with
    the caller's shared expert and residual update into one YNNPACK fusion whose float32 rounding differs from
    the same ops unfused, so the model's logits would move (~1e-5 on preset small) whenever its experts run
    elsewhere, e.g. through the mesh dispatch (sharding.expert_dispatch), which cannot be fused with its caller."""
    return jax.lax.optimization_barrier(jnp.sum(y_PD.reshape(T, k, -1), axis=1).astype(out_dtype))


def _tile_rows(x_TD, ids_TK, weights_TK, w1, w3, w2, limit: float, cdt, tile: int, tiles_per_step: int) -> jax.Array:
    """The tile form (see `xla`): every pair's output row [T*k, D] float32 (zeros for dropped pairs)."""
    D, E = x_TD.shape[1], w1.shape[0]
    mm = functools.partial(jnp.einsum, "gti,goi->gto", preferred_element_type=jnp.float32,
                           precision=product_precision(cdt))
    layout = group_layout(ids_TK, E, tile)
    n_t = layout.tile_expert.shape[0]
    G = max(1, min(tiles_per_step, n_t))
    n_s, pad = -(-n_t // G), -n_t % G  # the last step's extra tiles are zero rows of expert E - 1
    k = ids_TK.shape[1]
    P = ids_TK.size
    x, rw = _with_zero_row(x_TD, weights_TK, cdt)
    row_pair = jnp.concatenate([layout.row_pair, jnp.full((pad * tile,), P, jnp.int32)])
    tile_expert = jnp.concatenate([layout.tile_expert, jnp.full((pad,), E - 1, jnp.int32)])

    def one_step(s, y):
        pair = jax.lax.dynamic_slice_in_dim(row_pair, s * G * tile, G * tile).reshape(G, tile)
        e_s = jax.lax.dynamic_slice_in_dim(tile_expert, s * G, G)
        proj = lambda a, w: mm(a, _experts(w, e_s, cdt))  # noqa: E731
        x_s = x[pair // k]
        h = (_swiglu(proj(x_s, w1), proj(x_s, w3), limit) * rw[pair][..., None]).astype(cdt)
        return jax.lax.dynamic_update_slice_in_dim(y, proj(h, w2).reshape(G * tile, D), s * G * tile, 0)

    # only the steps holding rows run (the tiles with rows are a prefix); rows past them are never read
    n_steps = -(-layout.n_tiles[0] // G)
    y = jax.lax.fori_loop(0, n_steps, one_step, jnp.zeros((n_s * G * tile, D), jnp.float32))
    return _pair_rows(y[:n_t * tile], layout)


def _experts(w, e: jax.Array, cdt) -> jax.Array:
    """Experts e's weights [..., O, In] gathered, in the compute dtype (quantized ones decoded)."""
    if isinstance(w, QuantizedExperts):
        return decode_tile(w.kind, w.values[e], w.scales[e], w.block).astype(cdt)
    return w[e].astype(cdt)


GATHER_BYTES = 16 << 20  # decoded float32 expert weights a per-pair step may gather at once


SKIP_PAD_ROWS = 8  # steps of at most this many rows (decode) skip their trailing padding rows in the per-pair form


def _per_pair(x_TD, ids_TK, weights_TK, w1, w3, w2, limit: float, out_dtype, cdt):
    """Every (token, choice) pair with its own expert's weights gathered [P, O, In] (dropped ids weigh 0).

    A step of at most SKIP_PAD_ROWS rows computes only its first n: the rows up to the last one holding a routed
    pair, rounded up to a power of two (at most T; one compiled branch each), so a decode step's padding rows,
    whose ids the caller dropped (`MoE.routed`'s valid_T), gather and multiply nothing (a batch of one padded to
    two rows: half the pairs). Not for longer steps: a branch per size would multiply the program."""
    T, k = ids_TK.shape
    if T > SKIP_PAD_ROWS:
        return _sum_slots(_pairs(x_TD, ids_TK, weights_TK, w1, w3, w2, limit, cdt), T, k, out_dtype)
    E = w1.shape[0]
    sizes = sorted({min(T, 1 << i) for i in range(T.bit_length() + 1)})  # 1, 2, 4, ..., T
    live_T = jnp.any((ids_TK >= 0) & (ids_TK < E), axis=1)
    n_live = jnp.max(jnp.where(live_T, jnp.arange(1, T + 1), 0))
    branch = jnp.sum(jnp.asarray(sizes[:-1]) < n_live)  # the smallest size holding the live rows

    def first_rows(n: int):
        def run() -> jax.Array:
            y = _pairs(x_TD[:n], ids_TK[:n], weights_TK[:n], w1, w3, w2, limit, cdt)
            return jnp.pad(y, ((0, (T - n) * k), (0, 0)))
        return run

    y_PD = jax.lax.switch(branch, [first_rows(n) for n in sizes]) if len(sizes) > 1 else first_rows(T)()
    return _sum_slots(y_PD, T, k, out_dtype)


def _pairs(x_TD, ids_TK, weights_TK, w1, w3, w2, limit: float, cdt) -> jax.Array:
    """Every pair's output row [T*k, D] float32, each through its own gathered expert: three batched
    matrix-vector products."""
    k, E = ids_TK.shape[1], w1.shape[0]
    ids = ids_TK.reshape(-1).astype(jnp.int32)
    e = jnp.clip(ids, 0, E - 1)
    rw = jnp.where((ids >= 0) & (ids < E), weights_TK.reshape(-1).astype(jnp.float32), 0.0)
    mv = functools.partial(jnp.einsum, "pi,poi->po", preferred_element_type=jnp.float32,
                           precision=product_precision(cdt))
    x = jnp.repeat(x_TD.astype(cdt), k, axis=0)  # [P, D]
    h = (_swiglu(mv(x, _experts(w1, e, cdt)), mv(x, _experts(w3, e, cdt)), limit) * rw[:, None]).astype(cdt)
    return mv(h, _experts(w2, e, cdt))


def _batched_then_tiles(x_TD, ids_TK, weights_TK, w1, w3, w2, limit: float, cdt, C: int, tiles_per_step: int, *,
                        weights_left: bool) -> jax.Array:
    """The batched form (see `xla`): every pair's output row [T*k, D] float32. Expert e's first C rows (in
    expert-sorted order) as x [E, C, D] against the weights in place (on the left of the products with
    `weights_left`); the rows past C of the experts holding more (an unbalanced routing) through the
    tile form, in tiles of C rows, only when there are any (its own sort of the pairs: the cost of a rare case)."""
    if isinstance(w1, QuantizedExperts):
        raise ValueError("the batched form multiplies float expert weights in place; quantized ones take tiles")
    T, D = x_TD.shape
    k, E = ids_TK.shape[1], w1.shape[0]
    P = T * k
    key_P, order_P, counts_E, start_E = _expert_order(ids_TK, E)
    e_P = jnp.minimum(key_P, E - 1)
    rank_P = jnp.zeros(P, jnp.int32).at[order_P].set(jnp.arange(P, dtype=jnp.int32)) - start_E[e_P]
    at_EC = jnp.arange(C)[None]
    pair_EC = jnp.where(at_EC < counts_E[:, None], order_P[jnp.minimum(start_E[:, None] + at_EC, P - 1)], P)
    x, rw = _with_zero_row(x_TD, weights_TK, cdt)
    x_ECD, rw_EC = x[pair_EC // k], rw[pair_EC]
    mm = functools.partial(jnp.einsum, preferred_element_type=jnp.float32, precision=product_precision(cdt))
    c_P = jnp.minimum(rank_P, C - 1)
    if weights_left:  # h and y per expert transposed: [E, I, C], [E, D, C]
        h = _swiglu(mm("eoi,eci->eoc", w1, x_ECD), mm("eoi,eci->eoc", w3, x_ECD), limit)
        h = (h * rw_EC[:, None]).astype(cdt)
        y_head_PD = mm("eoi,eic->eoc", w2, h)[e_P, :, c_P]
    else:
        h = _swiglu(mm("eci,eoi->eco", x_ECD, w1), mm("eci,eoi->eco", x_ECD, w3), limit)
        h = (h * rw_EC[..., None]).astype(cdt)
        y_head_PD = mm("eci,eoi->eco", h, w2).reshape(E * C, D)[e_P * C + c_P]
    head_P, over_P = (key_P < E) & (rank_P < C), (key_P < E) & (rank_P >= C)  # dropped pairs: neither
    y_PD = jnp.where(head_P[:, None], y_head_PD, 0.0)

    def tail(y_PD):
        ids_over = jnp.where(over_P.reshape(T, k), ids_TK, -1)
        y_over_PD = _tile_rows(x_TD, ids_over, weights_TK, w1, w3, w2, limit, cdt, C, tiles_per_step)
        return jnp.where(over_P[:, None], y_over_PD, y_PD)

    return jax.lax.cond(jnp.any(over_P), tail, lambda y: y, y_PD)


# ================================================================================== pallas
class _Fmt(NamedTuple):
    """Static description of one weight operand: kind None = float array (one ref), else values + scales."""
    kind: str | None
    block: tuple[int, int]

    @property
    def n_refs(self) -> int:
        return 1 if self.kind is None else 2


def _fmt(w) -> _Fmt:
    return _Fmt(w.kind, w.block) if isinstance(w, QuantizedExperts) else _Fmt(None, (1, 1))


def _operands(w) -> list:
    return [w.values, w.scales] if isinstance(w, QuantizedExperts) else [w]


def _whole(shape):
    """BlockSpec of a whole array (Triton: a pointer; only what the kernel indexes is loaded)."""
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _weight_tile(refs, fmt: _Fmt, e, j, c, bn: int, bk: int, cdt):
    """Expert e's weight tile [bn, bk] at row block j, input chunk c, decoded in registers to `cdt`."""
    if fmt.kind is None:
        return refs[0][e, pl.ds(j * bn, bn), pl.ds(c * bk, bk)].astype(cdt)
    v_ref, s_ref = refs
    b0, b1 = fmt.block
    vk = bk // 2 if fmt.kind == "mxfp4" else bk
    v = v_ref[e, pl.ds(j * bn, bn), pl.ds(c * vk, vk)]
    s = s_ref[e, pl.ds(j * (bn // b0), bn // b0), pl.ds(c * (bk // b1), bk // b1)]
    return decode_tile(fmt.kind, v, s, fmt.block).astype(cdt)


def _tile_dot(a, w, prec):
    """a [m, bk] @ w [bn, bk]^T, float32 accumulation."""
    return jax.lax.dot_general(a, w, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=jnp.float32)


def _gate_up_kernel(tile_expert_ref, n_tiles_ref, x_ref, rw_ref, *refs, fmt1, fmt3, bn, bk, limit, prec):
    """h[rows of tile i, block j] = swiglu(x W1_e^T, x W3_e^T) * w_row, e the tile's expert."""
    w1_refs, w3_refs, h_ref = refs[:fmt1.n_refs], refs[fmt1.n_refs:-1], refs[-1]
    i, j = pl.program_id(0), pl.program_id(1)

    @pl.when(i < n_tiles_ref[0])
    def _():
        e = tile_expert_ref[i]
        cdt = h_ref.dtype

        def chunk(c, acc):
            xc = x_ref[:, pl.ds(c * bk, bk)]
            return (acc[0] + _tile_dot(xc, _weight_tile(w1_refs, fmt1, e, j, c, bn, bk, cdt), prec),
                    acc[1] + _tile_dot(xc, _weight_tile(w3_refs, fmt3, e, j, c, bn, bk, cdt), prec))

        zero = jnp.zeros((x_ref.shape[0], bn), jnp.float32)
        gate, up = jax.lax.fori_loop(0, x_ref.shape[1] // bk, chunk, (zero, zero))
        h_ref[...] = (_swiglu(gate, up, limit) * rw_ref[...][:, None]).astype(cdt)


def _down_kernel(tile_expert_ref, n_tiles_ref, h_ref, *refs, fmt2, bn, bk, prec):
    """y[rows of tile i, block j] = h W2_e^T, float32."""
    w2_refs, y_ref = refs[:-1], refs[-1]
    i, j = pl.program_id(0), pl.program_id(1)

    @pl.when(i < n_tiles_ref[0])
    def _():
        e = tile_expert_ref[i]

        def chunk(c, acc):
            return acc + _tile_dot(h_ref[:, pl.ds(c * bk, bk)],
                                   _weight_tile(w2_refs, fmt2, e, j, c, bn, bk, h_ref.dtype), prec)

        y_ref[...] = jax.lax.fori_loop(0, h_ref.shape[1] // bk, chunk,
                                       jnp.zeros((h_ref.shape[0], bn), jnp.float32))


def _pow2_divisor(n: int, cap: int) -> int:
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def _blocks(name: str, out_dim: int, in_dim: int, fmts: list[_Fmt], block_n: int, block_k: int) -> tuple[int, int]:
    """Power-of-two (rows, input chunk) dividing the weight, whole quantization blocks (grown to a block
    when it is larger, e.g. FP8 128 x 128), Triton-sized."""
    bn = _pow2_divisor(out_dim, max([block_n] + [f.block[0] for f in fmts]))
    bk = _pow2_divisor(in_dim, max([block_k] + [f.block[1] for f in fmts]))
    for f in fmts:
        if bn % f.block[0] or bk % f.block[1]:
            raise ValueError(f"{name}: tile {bn} x {bk} does not hold whole {f.kind} scale blocks {f.block}")
    if min(bn, bk) < MIN_DOT:
        raise ValueError(f"{name}: dims [{out_dim}, {in_dim}] allow only a {bn} x {bk} tile (Triton needs >= 16)")
    return bn, bk


def pallas(x_TD, ids_TK, weights_TK, w1, w3, w2, *, limit: float, out_dtype=jnp.float32, block_m: int | None = None,
           block_n: int = 64, block_k: int = 128, num_warps: int = 4, num_stages: int = 2,
           interpret: bool | None = None):
    """Two Pallas Triton kernels over (row tile, output block): gate/up + SwiGLU -> h [Np, I], then down ->
    y [Np, D]; each program reads its tile's expert id and walks the input dim in `block_k` chunks, decoding
    quantized weight tiles in registers. Sorting, row gather and the final combine are XLA. Default
    block_m: 16 rows (Triton's smallest dot) for decode batches, up to 64 when experts get many rows (at
    most half the mean rows per expert, so padding stays near a quarter of the rows). block_n x block_k
    = 64 x 128 keeps two decoded weight tiles within 4 warps' registers (first guesses, not tuned)."""
    _check(x_TD, ids_TK, weights_TK, w1, w3, w2)
    T, D = x_TD.shape
    k, (E, I) = ids_TK.shape[1], w1.shape[:2]
    cdt = _compute_dtype(x_TD, w1)
    prec = product_precision(cdt)
    bm = block_m or rows_per_tile(ids_TK.size // 2, E, MIN_DOT, 64)  # padding ~<= 25% of the rows
    if bm < MIN_DOT or bm & (bm - 1):
        raise ValueError(f"block_m {bm} must be a power of two >= {MIN_DOT}")
    f1, f3, f2 = _fmt(w1), _fmt(w3), _fmt(w2)
    bn1, bk1 = _blocks("w1/w3", I, D, [f1, f3], block_n, block_k)
    bn2, bk2 = _blocks("w2", D, I, [f2], block_n, block_k)
    interpret = interpret_default() if interpret is None else interpret
    params = plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)

    layout = group_layout(ids_TK, E, bm)
    xs, rw = _sorted_rows(x_TD.astype(cdt), weights_TK, layout)
    Np = xs.shape[0]
    meta = [layout.tile_expert, layout.n_tiles]
    meta_specs = [_whole(a.shape) for a in meta]
    w13 = _operands(w1) + _operands(w3)
    h = pl.pallas_call(
        functools.partial(_gate_up_kernel, fmt1=f1, fmt3=f3, bn=bn1, bk=bk1, limit=limit, prec=prec),
        grid=(Np // bm, I // bn1), out_shape=jax.ShapeDtypeStruct((Np, I), cdt),
        in_specs=meta_specs + [pl.BlockSpec((bm, D), lambda i, j: (i, 0)), pl.BlockSpec((bm,), lambda i, j: (i,))]
        + [_whole(a.shape) for a in w13],
        out_specs=pl.BlockSpec((bm, bn1), lambda i, j: (i, j)),
        interpret=interpret, name="moe_gate_up", compiler_params=params)(*meta, xs, rw, *w13)
    w2_ops = _operands(w2)
    y = pl.pallas_call(
        functools.partial(_down_kernel, fmt2=f2, bn=bn2, bk=bk2, prec=prec),
        grid=(Np // bm, D // bn2), out_shape=jax.ShapeDtypeStruct((Np, D), jnp.float32),
        in_specs=meta_specs + [pl.BlockSpec((bm, I), lambda i, j: (i, 0))] + [_whole(a.shape) for a in w2_ops],
        out_specs=pl.BlockSpec((bm, bn2), lambda i, j: (i, j)),
        interpret=interpret, name="moe_down", compiler_params=params)(*meta, h, *w2_ops)
    return _combine(y, layout, T, k, out_dtype)


# ================================================================================ dispatch
def routed_experts(x_TD, ids_TK, weights_TK, w1, w3, w2, *, limit: float, out_dtype=jnp.float32,
                   impl: str = "auto", small_steps: str = "rule"):
    """sum_j weights[t, j] * expert_{ids[t, j]}(x_t) [T, D] through the chosen implementation (`small_steps`: the
    XLA path's form for steps of few rows per expert, see `xla`)."""
    impl = resolve_impl(impl)
    if impl == "xla":
        return xla(x_TD, ids_TK, weights_TK, w1, w3, w2, limit=limit, out_dtype=out_dtype, small_steps=small_steps)
    fn = {"reference": reference, "pallas": pallas}[impl]
    return fn(x_TD, ids_TK, weights_TK, w1, w3, w2, limit=limit, out_dtype=out_dtype)
