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
