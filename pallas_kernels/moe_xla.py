"""The routed experts' XLA code (the op, its inputs and numerics: `pallas_kernels.moe_gmm`, which holds the
reference, the Pallas kernels and the dispatch): the operand checks and SwiGLU both paths share, the grouped layout
of the (token, slot) pairs (the Pallas path's too: its sort, row gather and combine are XLA), and `xla`, the CPU
path, in its batched, tile and per-pair forms, with the small-step forms the serving runtime chooses between
(`SMALL_STEP_FORMS`, `is_small_step`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.common import product_precision
from pallas_kernels.expert_weights import QuantizedExperts, check_experts, decode_tile


# ================================================================================ operands
def check_operands(x_TD, ids_TK, weights_TK, w1, w3, w2):
    """ValueError naming the first operand whose shape or dtype does not fit the op (`moe_gmm`'s docstring)."""
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


def compute_dtype(x_TD, w1) -> jnp.dtype:
    """The matmuls' dtype: the float weights', or x's for quantized weights."""
    return jnp.dtype(x_TD.dtype if isinstance(w1, QuantizedExperts) else w1.dtype)


def swiglu(gate, up, limit: float):
    """silu(min(gate, limit)) * clamp(up, -limit, limit), float32."""
    g = jnp.minimum(gate, limit)
    return g * jax.nn.sigmoid(g) * jnp.clip(up, -limit, limit)


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


def sorted_rows(x_TD, weights_TK, layout: GroupLayout):
    """x rows [Np, D] and combine weights [Np] in expert-sorted order (zeros on padding rows)."""
    x, w = _with_zero_row(x_TD, weights_TK, x_TD.dtype)
    return x[layout.row_pair // weights_TK.shape[1]], w[layout.row_pair]


def _pair_rows(y_ND, layout: GroupLayout) -> jax.Array:
    """Every pair's row of the expert-sorted output [T*k, D] float32; dropped pairs read an appended zero row."""
    return jnp.concatenate([y_ND.astype(jnp.float32), jnp.zeros((1, y_ND.shape[1]), jnp.float32)])[layout.pair_row]


def combine(y_ND, layout: GroupLayout, T: int, k: int, out_dtype):
    """out[t] = sum_j y[row of (t, j)], float32."""
    return jnp.sum(_pair_rows(y_ND, layout).reshape(T, k, -1), axis=1).astype(out_dtype)


# ===================================================================================== xla
def xla_tile(n_pairs: int, n_experts: int) -> int:
    """The XLA path's rows per tile: the power of two at or above the mean rows per expert, within [2, 256] (most
    experts' rows in one scan step; XLA:CPU's per-step cost outweighs the padding). Not 1: a one-row tile is a
    matrix-vector product, which XLA:CPU sums in another order than the same rows in a wider tile."""
    per_expert = max(1, -(-n_pairs // n_experts))
    return min(256, max(2, 1 << (per_expert - 1).bit_length()))


TILES_PER_STEP = 4  # the tile form's row tiles per loop step (see `xla`)


# The widest expert blocks (batched capacity, rows per expert) of a "small step" (decode), whose form is `xla`'s
# `small_steps`: where the rows are few, the batched form may put the weights on the left of its products
# (h = W x^T per expert), tiles may beat it, and which wins is the CPU's (see `xla`; `is_small_step`).
SMALL_STEP_MAX_ROWS = 32
SMALL_STEP_FORMS = ("batched_left", "batched_right", "tiles")
SMALL_STEPS = ("rule", *SMALL_STEP_FORMS)  # what `xla`'s `small_steps` takes ("rule": batched, weights right)


def batch_capacity(n_pairs: int, n_experts: int) -> int:
    """The batched form's rows per expert: 1.5 x the mean rows per expert, rounded up to a multiple of 8, at least 8,
    so that a balanced routing needs no tail (512 tokens x top-6 over 64 experts: mean 48, capacity 72, above the
    busiest expert of a random routing: docs/design/measurements.md)."""
    return max(8, -(-3 * n_pairs // (2 * n_experts * 8)) * 8)


def is_small_step(n_pairs: int, n_experts: int, inter: int, dim: int) -> bool:
    """Whether float experts [n_experts, inter, dim] over n_pairs (token, choice) pairs run `xla` as a small step,
    in the form its `small_steps` names: too many pairs for the per-pair form, a batched capacity <=
    SMALL_STEP_MAX_ROWS (what `xla` itself decides, for its default capacity and tile)."""
    return n_pairs * 3 * inter * dim * 4 > GATHER_BYTES and batch_capacity(n_pairs, n_experts) <= SMALL_STEP_MAX_ROWS


def xla(x_TD, ids_TK, weights_TK, w1, w3, w2, *, limit: float, out_dtype=jnp.float32, capacity: int | None = None,
        tile: int | None = None, tiles_per_step: int = TILES_PER_STEP, small_steps: str = "rule"):
    """CPU path, no ragged_dot (XLA:CPU's costs about E dense matmuls, jax-notes §4.3), in one of three forms:

    - batched (float weights; `capacity` forces it): every expert's first `capacity` rows (default
      `batch_capacity`), in expert-sorted order, as x [E, capacity, D], multiplied by the weights in place (on
      the right of the products; on the left in the "batched_left" small-step form): three GEMMs batched over the
      experts, which XLA:CPU runs on its fast (YNNPACK, AMX) path, where each of the tile form's many small GEMMs
      costs a fixed overhead whatever its size. The rows past `capacity` of the experts that hold more (an
      unbalanced routing: the peer checkpoint's random router sends most of a prompt's tokens to one expert) go
      through the tile form in tiles of `capacity` rows, skipped when there are none. Not for quantized weights:
      they would all be decoded each call.
    - tiles (quantized weights; `tile` forces it): a loop over steps of `tiles_per_step` row tiles of one
      expert each (only the steps holding rows run), the step's tiles as one batched matmul over their gathered,
      decoded experts: the rows actually routed plus at most tile - 1 padding rows per expert, decoding only the
      experts the routing touches. Default tile (`xla_tile`): the mean rows per expert rounded up to a power of two.
    - per pair: a step whose (token, choice) pairs' decoded weights fit GATHER_BYTES (a decode step of a few
      rows of a small model) gathers each pair's expert: three batched matrix-vector products; its trailing
      padding rows (ids dropped) are skipped (`_per_pair`).

    Steps of few rows per expert (float weights, a batched capacity <= SMALL_STEP_MAX_ROWS: decode steps,
    `is_small_step`) take the form `small_steps` names: "rule" (batched) or one of SMALL_STEP_FORMS, chosen by the
    caller (the serving runtime times them once per machine, outside any trace: `serving.runtime.moe_tuning`).
    Which wins is the CPU's: at 8 tokens of the peer shape in bf16 the weights-left form was the fastest on a 2-core
    AMX Xeon and the slowest on a 2-core AVX512-BF16 EPYC (no AMX), where tiles won and the weights-left product
    alone ran far slower than the weights-right one. On that EPYC the weights-left products sum in another order
    (their bits differ), on the AMX Xeon they gave the same bits.

    Every form multiplies each row alone and sums a token's k rows in slot order, so they agree to the bit
    wherever XLA:CPU's dots sum a row the same way (on this CPU the batched and tile forms gave the same bits in
    bf16 and float32 at the peer shape).

    Measured on the peer V4's MoE (docs/design/measurements.md): with float weights the batched form beats tiles at
    every step size, routing balanced or not; with MXFP4 weights a tile near the mean rows per expert is the
    fastest, and four tiles per step beat one; the per-pair form beats tiles on a few tokens but not on 8 (hence
    the GATHER_BYTES bound)."""
    check_operands(x_TD, ids_TK, weights_TK, w1, w3, w2)
    if small_steps not in SMALL_STEPS:
        raise ValueError(f"small_steps must be one of {SMALL_STEPS}, got {small_steps!r}")
    T, D = x_TD.shape
    k, (E, I) = ids_TK.shape[1], w1.shape[:2]
    cdt = compute_dtype(x_TD, w1)
    forced = capacity is not None or tile is not None
    if not forced and ids_TK.size * 3 * I * D * 4 <= GATHER_BYTES:
        return _per_pair(x_TD, ids_TK, weights_TK, w1, w3, w2, limit, out_dtype, cdt)
    C = capacity or batch_capacity(ids_TK.size, E)
    form = "tiles" if tile is not None or (capacity is None and isinstance(w1, QuantizedExperts)) else "batched_right"
    if form == "batched_right" and C <= SMALL_STEP_MAX_ROWS and small_steps != "rule":
        form = small_steps
    if form == "tiles":
        y_PD = _tile_rows(x_TD, ids_TK, weights_TK, w1, w3, w2, limit, cdt, tile or xla_tile(ids_TK.size, E),
                          tiles_per_step)
    else:
        y_PD = _batched_then_tiles(x_TD, ids_TK, weights_TK, w1, w3, w2, limit, cdt, C, tiles_per_step,
                                   weights_left=form == "batched_left")
    return _sum_slots(y_PD, T, k, out_dtype)


def _sum_slots(y_PD, T: int, k: int, out_dtype) -> jax.Array:
    """out[t] = sum_j y[t * k + j] in slot order, float32, materialized: XLA:CPU would otherwise fuse the sum with
    the caller's shared expert and residual update into one YNNPACK fusion whose float32 rounding differs from
    the same ops unfused, so the model's logits would move (float32 noise: docs/design/measurements.md) whenever
    its experts run elsewhere, e.g. through the mesh dispatch (sharding.expert_dispatch), which cannot be fused with
    its caller."""
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
        h = (swiglu(proj(x_s, w1), proj(x_s, w3), limit) * rw[pair][..., None]).astype(cdt)
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
    h = (swiglu(mv(x, _experts(w1, e, cdt)), mv(x, _experts(w3, e, cdt)), limit) * rw[:, None]).astype(cdt)
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
        h = swiglu(mm("eoi,eci->eoc", w1, x_ECD), mm("eoi,eci->eoc", w3, x_ECD), limit)
        h = (h * rw_EC[:, None]).astype(cdt)
        y_head_PD = mm("eoi,eic->eoc", w2, h)[e_P, :, c_P]
    else:
        h = swiglu(mm("eci,eoi->eco", x_ECD, w1), mm("eci,eoi->eco", x_ECD, w3), limit)
        h = (h * rw_EC[..., None]).astype(cdt)
        y_head_PD = mm("eci,eoi->eco", h, w2).reshape(E * C, D)[e_P * C + c_P]
    head_P, over_P = (key_P < E) & (rank_P < C), (key_P < E) & (rank_P >= C)  # dropped pairs: neither
    y_PD = jnp.where(head_P[:, None], y_head_PD, 0.0)

    def tail(y_PD):
        ids_over = jnp.where(over_P.reshape(T, k), ids_TK, -1)
        y_over_PD = _tile_rows(x_TD, ids_over, weights_TK, w1, w3, w2, limit, cdt, C, tiles_per_step)
        return jnp.where(over_P[:, None], y_over_PD, y_PD)

    return jax.lax.cond(jnp.any(over_P), tail, lambda y: y, y_PD)
