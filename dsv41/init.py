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


def random_release_params(c: ModelConfig, abstract: dict[tuple, jax.ShapeDtypeStruct], seed: int = 0,
                          *, on_host: frozenset = frozenset()) -> dict[tuple, object]:
    """Random parameters already in the release formats of `abstract` (`dsv41.weight_formats`), drawn as bytes:
    FP8 linears as e4m3 of N(0, 16) with a block exponent giving rows of about unit norm, MXFP4 experts as random
    e2m1 codes with a like exponent, FP8 Engram rows likewise; other tensors as `random_params`. Each tensor goes
    to the device as soon as it is drawn, so host memory holds one tensor: full-width presets (v41-flash-slice,
    65 GB) can be built without a float copy of the model. Paths in `on_host` stay NumPy arrays (host Engram
    tables); the draws are the same either way."""
    import jax.numpy as jnp
    import ml_dtypes

    rng = np.random.default_rng(seed)
    out = {}
    for path in sorted(abstract, key=lambda p: tuple(str(x) for x in p)):
        spec, leaf = abstract[path], str(path[-1])
        put = (lambda a: a) if path in on_host else jnp.asarray
        dtype = np.dtype(spec.dtype)
        if leaf.endswith("scale") and dtype == np.uint8:
            continue  # drawn with its values below
        sibling = path[:-1] + ((leaf + "_scale",) if leaf in ("w1", "w2", "w3") else ("scale",))
        if dtype == np.dtype(ml_dtypes.float8_e4m3fn):  # FP8 linear or Engram table: e4m3 x 2**(byte - 127)
            rows_in = spec.shape[-1]
            v = np.empty(spec.shape, ml_dtypes.float8_e4m3fn)
            step = max(1, (1 << 26) // rows_in)  # ~64M values per draw: a 6 GB Engram table never becomes 24 GB
            for r in range(0, spec.shape[0], step):
                chunk = v[r:r + step]
                chunk[...] = 4.0 * rng.standard_normal(chunk.shape, dtype=np.float32)
            exp = 127 - int(np.round(np.log2(4.0 * np.sqrt(rows_in))))
            out[path] = put(v)
            out[sibling] = put(np.full(abstract[sibling].shape, exp, np.uint8))
        elif dtype == np.uint8 and sibling in abstract:  # packed MXFP4 experts: random e2m1 codes (rms ~3.3)
            In = 2 * spec.shape[-1]
            out[path] = put(rng.integers(0, 256, spec.shape, dtype=np.uint8))
            out[sibling] = put(np.full(abstract[sibling].shape, 127 - int(np.round(np.log2(3.3 * np.sqrt(In)))),
                                       np.uint8))
        else:
            out[path] = put(_draw(path, spec.shape, rng, c).astype(dtype))
    return out
