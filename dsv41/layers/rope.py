"""Partial, interleaved (GPT-J) RoPE on the trailing `qk_rope_head_dim` channels (spec §2.4).

Two tables: "main" (rope_theta, no scaling) for SWA-only layers and DSpark blocks; "compress"
(compress_rope_theta with DeepSeek-YaRN, no mscale) for every compressed layer, used by its query, SWA
KV, global KV and indexer q/k alike. Inverse RoPE (angle -theta) undoes the rotation the value channels
picked up, on the attention output.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsv41.config import ModelConfig, yarn_bounds


@functools.cache
def _inv_freq_cached(c: ModelConfig, kind: str) -> tuple[float, ...]:
    d = c.qk_rope_head_dim
    if kind == "main":
        base = np.float32(c.rope_theta)
        return tuple(1.0 / base ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d)))
    y = c.rope_scaling
    if y is None:
        raise ValueError("the compress RoPE table needs rope_scaling (YaRN)")
    base = np.float32(c.compress_rope_theta)
    pos_freqs = base ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d))
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (np.float32(y.factor) * pos_freqs)
    low, high = yarn_bounds(c)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(d // 2, dtype=np.float32) - low) / np.float32(high - low), 0, 1)
    extra_factor = 1.0 - ramp
    return tuple((interpolation * (1 - extra_factor) + extrapolation * extra_factor).astype(np.float32))


def inv_freq(c: ModelConfig, kind: str) -> np.ndarray:
    """[qk_rope_head_dim // 2] float32 inverse frequencies of the "main" or "compress" table."""
    return np.asarray(_inv_freq_cached(c, kind), np.float32)


def rope_angles(positions: jax.Array, freqs: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos, sin [..., d_r/2] for integer positions [...]."""
    theta = positions.astype(jnp.float32)[..., None] * jnp.asarray(freqs)
    return jnp.cos(theta), jnp.sin(theta)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, *, inverse: bool = False) -> jax.Array:
    """Rotate adjacent pairs of the last 2*cos.shape[-1] channels of x [..., C].

    cos/sin broadcast against x without its channel axis (e.g. [T, 1, d_r/2] for x [T, H, C]).
    """
    rd = 2 * cos.shape[-1]
    nope, rot = x[..., :-rd], x[..., -rd:].astype(jnp.float32)
    a, b = rot[..., 0::2], rot[..., 1::2]
    if inverse:
        sin = -sin
    out = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(rot.shape)
    return jnp.concatenate([nope, out.astype(x.dtype)], axis=-1)
