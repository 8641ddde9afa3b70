"""KV compressors (spec §2.6): hidden states -> one global KV row per `ratio` tokens.

V4.1 (`Compressor`, KV-source layers only): ratio 1 = RMSNorm(wkv x) per token; ratio 2 = per-channel
softmax gate over the two tokens of a group, then RMSNorm. Row j covers tokens [j*r, j*r + r - 1] and is
rotated at position j*r; a group is usable once its last token is processed (an odd-length prefix leaves
an open group, which has no row yet).
V4 (`V4Compressor`, compat mode): ratio 4 with two overlapping series (Ca of window w-1 and Cb of window w
pooled over 2r slots) and ratio 128 without overlap, both with a learned `ape` added to the gate.

All pooling math is float32 (the release keeps wkv/wgate in BF16 and projects to fp32). The norm, RoPE and
index keys after the pooling are `dsv41.layers.attention.publish_kv_source`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41.layers.basic import Linear, RMSNorm


class Compressor(nnx.Module):
    """V4.1: wkv [d, D], wgate [d, D] (ratio 2 only), norm [d]."""

    def __init__(self, dim: int, head_dim: int, ratio: int, eps: float, *, dtype: jnp.dtype):
        if ratio not in (1, 2):
            raise ValueError(f"V4.1 compressors have ratio 1 or 2, got {ratio}")
        self.ratio = ratio
        self.wkv = Linear(dim, head_dim, dtype=dtype)
        self.wgate = Linear(dim, head_dim, dtype=dtype) if ratio == 2 else None
        self.norm = RMSNorm(head_dim, eps, dtype=dtype)

    def project(self, x_TD: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """Per-token float32 kv [T, d] and gate logits [T, d] (None for ratio 1)."""
        kv = self.wkv(x_TD, jnp.float32)
        gate = self.wgate(x_TD, jnp.float32) if self.wgate is not None else None
        return kv, gate

    def pool(self, kv_Td: jax.Array, gate_Td: jax.Array | None) -> jax.Array:
        """Closed groups of a sequence starting at position 0: [T // ratio, d] float32."""
        if self.ratio == 1:
            return kv_Td
        n, d = kv_Td.shape[0] // 2, kv_Td.shape[1]
        kv = kv_Td[: 2 * n].reshape(n, 2, d)
        w = jax.nn.softmax(gate_Td[: 2 * n].reshape(n, 2, d), axis=1)
        return jnp.sum(w * kv, axis=1)

    def pool_chunk(self, kv_Td: jax.Array, gate_Td: jax.Array | None, start: int,
                   tail: tuple[jax.Array, jax.Array] | None) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """Pool a chunk of positions [start, start + T) given the open-group tail carried from the previous
        chunk (the raw fp32 kv and gate row of position start - 1 when start is odd, else None).

        Returns the rows of the groups that close inside the chunk, pooled [n, d], and the new tail
        (None when start + T is even): the state an engine keeps per request for ratio-2 layers.
        """
        if self.ratio == 1:
            return kv_Td, None
        if start % 2:
            if tail is None:
                raise ValueError(f"chunk starts at odd position {start}: the open group's tail is required")
            kv_Td = jnp.concatenate([tail[0][None], kv_Td])
            gate_Td = jnp.concatenate([tail[1][None], gate_Td])
        new_tail = (kv_Td[-1], gate_Td[-1]) if kv_Td.shape[0] % 2 else None
        return self.pool(kv_Td, gate_Td), new_tail

    def pooled(self, x_TD: jax.Array) -> jax.Array:
        """The closed groups of a sequence starting at position 0, pooled before the norm: [T // ratio, d] float32."""
        return self.pool(*self.project(x_TD))


class V4Compressor(nnx.Module):
    """V4 compat: wkv/wgate [k*d, D], ape [ratio, k*d] (float32), norm [d]; k = 2 with overlap (ratio 4)."""

    def __init__(self, dim: int, head_dim: int, ratio: int, overlap: bool, eps: float, *, dtype: jnp.dtype):
        k = 2 if overlap else 1
        self.ratio, self.overlap, self.head_dim = ratio, overlap, head_dim
        self.wkv = Linear(dim, k * head_dim, dtype=dtype)
        self.wgate = Linear(dim, k * head_dim, dtype=dtype)
        self.ape = nnx.Param(jnp.zeros((ratio, k * head_dim), jnp.float32))
        self.norm = RMSNorm(head_dim, eps, dtype=dtype)

    def pooled(self, x_TD: jax.Array) -> jax.Array:
        """The closed windows of a sequence starting at position 0, pooled before the norm: [T // ratio, d]
        float32."""
        r, d = self.ratio, self.head_dim
        n = x_TD.shape[0] // r
        width = self.ape.shape[-1]
        kv = self.wkv(x_TD[: n * r], jnp.float32).reshape(n, r, width)
        gate = self.wgate(x_TD[: n * r], jnp.float32).reshape(n, r, width) + self.ape[...]
        if self.overlap:
            # Row w pools window w-1's first series (Ca) and window w's second series (Cb) over 2r slots;
            # window 0 has no predecessor: its Ca slots get gate -inf (softmax weight 0).
            prev_kv = jnp.concatenate([jnp.zeros_like(kv[:1, :, :d]), kv[:-1, :, :d]], axis=0)
            prev_gate = jnp.concatenate([jnp.full_like(gate[:1, :, :d], -jnp.inf), gate[:-1, :, :d]], axis=0)
            kv = jnp.concatenate([prev_kv, kv[:, :, d:]], axis=1)
            gate = jnp.concatenate([prev_gate, gate[:, :, d:]], axis=1)
        return jnp.sum(jax.nn.softmax(gate, axis=1) * kv, axis=1)
