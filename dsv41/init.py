"""Deterministic random parameters, drawn on the host with NumPy (never a jitted random init).

For tests, tools and the built-in default model: every constant-initialised tensor (norm weights, sinks,
mHC bases, router biases, `ape`) gets noise so that a swapped or dropped tensor changes the logits.
"""

from __future__ import annotations

import jax
import numpy as np

from dsv41 import quant
from dsv41.config import ModelConfig

_NORMS = {"attn_norm", "ffn_norm", "q_norm", "kv_norm", "norm", "k_norm", "main_norm"}


def _draw(path: tuple, shape: tuple[int, ...], rng: np.random.Generator, c: ModelConfig) -> np.ndarray:
    leaf, parent = path[-1], path[-2] if len(path) > 1 else ""
    n = rng.standard_normal(shape, dtype=np.float32)
    if leaf == "tid2eid":
        return np.stack([rng.permutation(c.n_routed_experts)[: shape[1]] for _ in range(shape[0])]).astype(np.int32)
    if (leaf == "weight" and parent in _NORMS) or leaf in ("q_weight", "k_weight"):
        return 1.0 + 0.1 * n
    if leaf == "attn_sink":
        return 0.5 * n
    if leaf in ("base", "bias", "ape"):
        return 0.1 * n
    if leaf == "scale" and parent in ("hc_attn", "hc_ffn", "hc_head"):
        return 0.5 + 0.1 * n
    if leaf == "fn":
        return n / np.sqrt(shape[-1]) * 4.0
    if parent in ("embed", "markov_embed"):
        return 0.5 * n
    return n / np.sqrt(shape[-1])


def random_params(c: ModelConfig, abstract: dict[tuple, jax.ShapeDtypeStruct], seed: int = 0
                  ) -> dict[tuple, np.ndarray]:
    """NumPy arrays for every parameter path of `abstract` (drawn in sorted path order)."""
    rng = np.random.default_rng(seed)
    out = {}
    for path in sorted(abstract, key=lambda p: tuple(str(x) for x in p)):
        spec = abstract[path]
        if path[-1] == "scale" and path[-2] == "embed":  # FP8 Engram table scale: drawn with its weight
            continue
        a = _draw(path, spec.shape, rng, c)
        if spec.dtype == np.dtype("float8_e4m3fn"):  # FP8 Engram table: quantize rows with 1x32 scales
            q, s = quant.quantize_fp8_blocks(0.5 * a.reshape(-1, a.shape[-1]), (1, 32))
            out[path], out[path[:-1] + ("scale",)] = q, s
        else:
            out[path] = a.astype(spec.dtype)
    return out


_CHUNK_VALUES = 1 << 24  # values per draw: chunks of a tensor are drawn in parallel, each from its own seed


def _e4m3_normal_table(std: float):
    """65,536 e4m3 codes at the quantiles of N(0, std^2): indexing it with uniform 16-bit draws gives e4m3 values of
    that normal distribution, far faster than drawing float32 normals and rounding them to e4m3
    (docs/design/measurements.md)."""
    import ml_dtypes
    from statistics import NormalDist

    q = NormalDist(0.0, std).inv_cdf
    return np.array([q((i + 0.5) / 65536) for i in range(65536)], np.float32).astype(ml_dtypes.float8_e4m3fn)


def _draw_chunked(shape: tuple[int, ...], dtype, seed: tuple[int, ...], fill, pool) -> np.ndarray:
    """An array of `shape` filled in chunks of rows (first axis) of ~`_CHUNK_VALUES` values, chunk i by
    `fill(rng, chunk_shape)` with rng seeded by (*seed, i): the same bits for any number of worker threads.
    Arrays of fewer than two axes are one chunk (`fill` may depend on the last axis' length)."""
    out = np.empty(shape, dtype)
    if len(shape) < 2:
        out[...] = fill(np.random.default_rng((*seed, 0)), shape)
        return out
    rows = max(1, _CHUNK_VALUES // (int(np.prod(shape[1:], dtype=np.int64)) or 1))

    def one(i: int) -> None:
        chunk = out[i * rows:(i + 1) * rows]
        chunk[...] = fill(np.random.default_rng((*seed, i)), chunk.shape)

    list(pool.map(one, range(-(-shape[0] // rows))))
    return out


def random_release_params(c: ModelConfig, abstract: dict[tuple, jax.ShapeDtypeStruct], seed: int = 0,
                          *, on_host: frozenset = frozenset(), workers: int | None = None) -> dict[tuple, object]:
    """Random parameters already in the release formats of `abstract` (`dsv41.weight_formats`), drawn as bytes:
    FP8 linears as e4m3 of N(0, 16) with a block exponent giving rows of about unit norm, MXFP4 experts as random
    e2m1 codes with a like exponent, FP8 Engram rows likewise; other tensors as `random_params`. Each tensor goes
    to the device as soon as it is drawn, so host memory holds one tensor: full-width presets (v41-flash-slice,
    65 GB) can be built without a float copy of the model. Paths in `on_host` stay NumPy arrays (host Engram
    tables); the draws are the same either way. Tensors are drawn in chunks by `workers` threads (default: one
    per CPU), each chunk from a seed of (seed, tensor, chunk), so the bits do not depend on `workers`."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    import jax.numpy as jnp
    import ml_dtypes

    e4m3 = _e4m3_normal_table(4.0)
    out = {}
    with ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
        for n, path in enumerate(sorted(abstract, key=lambda p: tuple(str(x) for x in p))):
            spec, leaf = abstract[path], str(path[-1])
            put = (lambda a: a) if path in on_host else jnp.asarray
            dtype, key = np.dtype(spec.dtype), (seed, n)
            if leaf.endswith("scale") and dtype == np.uint8:
                continue  # drawn with its values below
            sibling = path[:-1] + ((leaf + "_scale",) if leaf in ("w1", "w2", "w3") else ("scale",))
            if dtype == np.dtype(ml_dtypes.float8_e4m3fn):  # FP8 linear or Engram table: e4m3 x 2**(byte - 127)
                rows_in = spec.shape[-1]
                v = _draw_chunked(spec.shape, dtype, key, lambda r, s: e4m3[r.integers(0, 65536, s, np.uint16)], pool)
                exp = 127 - int(np.round(np.log2(4.0 * np.sqrt(rows_in))))
                out[path] = put(v)
                out[sibling] = put(np.full(abstract[sibling].shape, exp, np.uint8))
            elif dtype == np.uint8 and sibling in abstract:  # packed MXFP4 experts: random e2m1 codes (rms ~3.3)
                In = 2 * spec.shape[-1]
                out[path] = put(_draw_chunked(spec.shape, dtype, key, lambda r, s: r.integers(0, 256, s, np.uint8),
                                              pool))
                out[sibling] = put(np.full(abstract[sibling].shape, 127 - int(np.round(np.log2(3.3 * np.sqrt(In)))),
                                           np.uint8))
            elif path[-1] == "tid2eid":  # rows drawn together (a permutation each)
                out[path] = put(_draw(path, spec.shape, np.random.default_rng(key), c).astype(dtype))
            else:  # `_draw` depends on the path and the last axis only, so chunks of rows draw the same way
                out[path] = put(_draw_chunked(spec.shape, dtype, key, lambda r, s: _draw(path, s, r, c), pool))
    return out
