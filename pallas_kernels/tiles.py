"""Query tiles: the work plan the XLA paths of the attention and indexer ops loop over.

A tile is up to `size` consecutive query rows of one request, so its rows share one request's cache
reads (its SWA ring, its in-call rows, its block table): the XLA path gathers them once per tile and
evaluates the tile's queries as small matrix products. The plan is made on the host from each request's
rows (`plan_tiles`), padded to a static tile count; a call without a plan runs every row as its own tile
(`row_tiles`). The Pallas kernels do not read it (one program per query row).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

TILE_GROUP = 64  # tiles evaluated together (vectorised) per loop iteration of lax.map


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QueryTiles:
    req_N: jax.Array  # [NT] request of the tile
    first_N: jax.Array  # [NT] flat index of its first query row
    n_N: jax.Array  # [NT] valid rows (0 for padding tiles)
    size: int = dataclasses.field(metadata=dict(static=True))  # rows per tile

    @property
    def count(self) -> int:
        return self.req_N.shape[-1]


def max_tiles(rows: int, requests: int, size: int) -> int:
    """Most tiles `rows` query rows of up to `requests` requests can need: a request of q rows needs
    ceil(q / size) <= (q + size - 1) / size of them."""
    return (rows + min(rows, requests) * (size - 1)) // size


def plan_tiles(first_R: np.ndarray, qlen_R: np.ndarray, size: int, n_tiles: int) -> QueryTiles:
    """Host plan (NumPy arrays) for requests whose rows are [first, first + qlen) of the flat layout."""
    req, t0, n = [], [], []
    for r, (f, q) in enumerate(zip(first_R, qlen_R)):
        for o in range(0, int(q), size):
            req.append(r)
            t0.append(int(f) + o)
            n.append(min(size, int(q) - o))
    if len(req) > n_tiles:
        raise ValueError(f"{len(req)} tiles exceed the planned {n_tiles}")
    pad = [0] * (n_tiles - len(req))
    return QueryTiles(np.array(req + pad, np.int32), np.array(t0 + pad, np.int32), np.array(n + pad, np.int32), size)


def row_tiles(req_T: jax.Array) -> QueryTiles:
    """Every query row its own tile (any row order; no plan needed)."""
    T = req_T.shape[0]
    return QueryTiles(req_T, jnp.arange(T, dtype=jnp.int32), jnp.ones((T,), jnp.int32), 1)


def plan_or_rows(tiles: QueryTiles | None, req_T: jax.Array) -> QueryTiles:
    """A call's tile plan as arrays (a host plan may still be NumPy), or one row per tile without one."""
    return row_tiles(req_T) if tiles is None else jax.tree.map(jnp.asarray, tiles)


def tile_rows(tiles: QueryTiles, i: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array]:
    """Flat row indices [size] of tile i (clamped into range) and their validity."""
    u = jnp.arange(tiles.size)
    return jnp.clip(tiles.first_N[i] + u, 0, num_rows - 1), u < tiles.n_N[i]


def map_tiles(fn, tiles: QueryTiles):
    """fn(i) over the tiles in vectorised groups of TILE_GROUP (bounded memory); outputs stacked [NT, ...].

    A group past the last tile holding rows is skipped (its outputs are zeros; `to_flat_rows` reads no row of
    them): a plan is padded to the most tiles any step of its bucket can need (`max_tiles`: a partial tile per
    request slot), and one request's 512-row prefill in 8-row tiles fills 64 of a 92-tile plan."""
    NT = tiles.count
    G = min(TILE_GROUP, NT)
    used = jnp.max(jnp.where(tiles.n_N > 0, jnp.arange(NT) + 1, 0))  # real tiles come first (plan_tiles)
    group_fn = jax.vmap(fn)

    def group(i_G):
        traced = []  # the run branch's output shapes: skip needs them, and fn is the dearest thing to trace

        def run(i_G):
            out = group_fn(i_G)
            traced.append(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), out))
            return out

        def skip(i_G):  # lax.cond traces its true branch first; should that change, fn is traced again here
            shapes = traced[0] if traced else jax.eval_shape(group_fn, i_G)
            return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
        return jax.lax.cond(i_G[0] < used, run, skip, i_G)

    full = NT // G
    outs = [jax.tree.map(lambda a: a.reshape(full * G, *a.shape[2:]),
                         jax.lax.map(group, jnp.arange(full * G).reshape(full, G)))]
    if NT % G:
        outs.append(group(jnp.arange(full * G, NT)))
    return jax.tree.map(lambda *a: jnp.concatenate(a), *outs) if len(outs) > 1 else outs[0]


def to_flat_rows(x_NTu: jax.Array, tiles: QueryTiles, num_rows: int, fill) -> jax.Array:
    """Per-tile rows [NT, size, ...] back to the flat layout [num_rows, ...]; rows no tile covers get `fill`.

    Each flat row's tile slot is scattered (NT * size integers), then the rows are gathered: XLA:CPU scatters
    whole rows into a filled buffer several times slower (docs/design/measurements.md)."""
    n_slots = tiles.count * tiles.size
    dest = tiles.first_N[:, None] + jnp.arange(tiles.size)
    dest = jnp.where(jnp.arange(tiles.size)[None] < tiles.n_N[:, None], dest, num_rows)  # padding -> dropped
    slot_T = jnp.full((num_rows,), n_slots, jnp.int32).at[dest.reshape(-1)].set(
        jnp.arange(n_slots, dtype=jnp.int32), mode="drop")  # n_slots: no tile covers the row
    rows = x_NTu.reshape(-1, *x_NTu.shape[2:])[jnp.minimum(slot_T, n_slots - 1)]
    covered = (slot_T < n_slots).reshape(-1, *(1,) * (rows.ndim - 1))
    return jnp.where(covered, rows, jnp.asarray(fill, rows.dtype))
