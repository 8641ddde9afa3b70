"""The XLA paths' tile loop: every tile holding rows is evaluated, the padding groups past the last one are not."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.tiles import TILE_GROUP, max_tiles, plan_tiles, map_tiles, to_flat_rows


def _fn(tiles):
    """A tile's output from its plan entry, so every evaluated tile leaves a non-zero mark."""
    return lambda i: jnp.stack([tiles.req_N[i] + 1, tiles.first_N[i] + 1, tiles.n_N[i]]).astype(jnp.float32)


@pytest.mark.parametrize("qlen, requests", [([512], 32), ([100, 5], 128), ([8 * TILE_GROUP + 3, 5], 128)])
def test_map_tiles_runs_every_tile_with_rows_and_skips_padding_groups(qlen, requests):
    size = 8
    T = sum(qlen)
    n_tiles = max_tiles(T, requests, size)
    tiles = plan_tiles(np.cumsum([0, *qlen[:-1]]), np.array(qlen), size, n_tiles)
    used = int(np.sum(tiles.n_N > 0))
    jt = jax.tree.map(jnp.asarray, tiles)
    out = np.asarray(jax.jit(lambda t: map_tiles(_fn(t), t))(jt))
    want = np.stack([tiles.req_N + 1, tiles.first_N + 1, tiles.n_N], axis=1).astype(np.float32)
    G = min(TILE_GROUP, n_tiles)
    assert out.shape == (n_tiles, 3)
    np.testing.assert_array_equal(out[:used], want[:used])
    first_skipped = -(-used // G) * G
    assert first_skipped < n_tiles, "the plan must hold a whole padding group for this test to mean anything"
    np.testing.assert_array_equal(out[first_skipped:], 0.0)  # not evaluated (fn would have marked them)


@pytest.mark.parametrize("n_tiles, traces", [(2 * TILE_GROUP, 1), (2 * TILE_GROUP + 3, 2)])
def test_map_tiles_traces_fn_once_per_group_shape(n_tiles, traces):
    """fn (a layer's attention or indexer tile: the dearest part of a segment program to trace) is traced once for
    the loop's groups and once more only for a trailing partial group - not again for the skipped groups' zeros."""
    tiles = plan_tiles(np.array([0]), np.array([40]), 8, n_tiles)
    jt = jax.tree.map(jnp.asarray, tiles)
    calls = []

    def fn(i):
        calls.append(i)
        return _fn(jt)(i)

    jax.make_jaxpr(lambda: map_tiles(fn, jt))()
    assert len(calls) == traces


def test_to_flat_rows_reads_only_the_tiles_with_rows():
    size, qlen = 4, np.array([6, 3])
    tiles = plan_tiles(np.array([0, 6]), qlen, size, max_tiles(9, 8, size))
    jt = jax.tree.map(jnp.asarray, tiles)
    rows = np.asarray(to_flat_rows(map_tiles(lambda i: jt.first_N[i] + jnp.arange(size), jt), jt, 10, -1))
    np.testing.assert_array_equal(rows, [0, 1, 2, 3, 4, 5, 6, 7, 8, -1])
