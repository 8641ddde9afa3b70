"""Attention block of every layer (spec §2.5): one shared K=V latent per token, attention sink, inverse
RoPE on the output and a grouped low-rank output projection.

Keys of the query at position p: its own layer's SWA rows (positions max(p - W + 1, 0) .. p, self included)
plus, in compressed layers, the global rows its index source selected. K and V are the same 512-d vector
(value channels include the rotated RoPE slice, which the inverse RoPE on the output undoes).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41.config import LayerRole, ModelConfig
from dsv41.layers.basic import Linear, RMSNorm, matmul_precision, rms_norm
from dsv41.layers.compressor import Compressor, V4Compressor
from dsv41.layers.indexer import Indexer
from dsv41.layers.rope import apply_rope
from dsv41.quant import fake_quant_fp8


GROUPED_BATCHED_MAX_ROWS = 256  # the grouped output projection's batched form up to this many rows (project_out)


class Attention(nnx.Module):
    """wq_a [q, D], q_norm [q], wq_b [H*d, q], wkv [d, D], kv_norm [d], wo_a [G*o, H*d/G], wo_b [D, G*o],
    attn_sink [H]; plus `compressor` on KV sources and `indexer` on index sources."""

    def __init__(self, c: ModelConfig, role: LayerRole, *, dtype: jnp.dtype, n_heads: int | None = None):
        H = n_heads or c.num_attention_heads
        D, d, q = c.hidden_size, c.head_dim, c.q_lora_rank
        self.n_heads, self.head_dim, self.o_groups = H, d, c.o_groups
        self.eps, self.q_head_norm = c.rms_norm_eps, c.q_head_norm
        self.wq_a = Linear(D, q, dtype=dtype)
        self.q_norm = RMSNorm(q, c.rms_norm_eps, dtype=dtype)
        self.wq_b = Linear(q, H * d, dtype=dtype)
        self.wkv = Linear(D, d, dtype=dtype)
        self.kv_norm = RMSNorm(d, c.rms_norm_eps, dtype=dtype)
        self.wo_a = Linear(H * d // c.o_groups, c.o_groups * c.o_lora_rank, dtype=dtype)
        self.wo_b = Linear(c.o_groups * c.o_lora_rank, D, dtype=dtype)
        self.attn_sink = nnx.Param(jnp.zeros((H,), jnp.float32))
        r = role.compress_ratio
        compressor: Compressor | V4Compressor | None = None
        if role.attn_kind in ("csa", "hca"):
            compressor = V4Compressor(D, d, r, overlap=role.attn_kind == "csa", eps=c.rms_norm_eps, dtype=dtype)
        elif role.is_kv_source:
            compressor = Compressor(D, d, r, c.rms_norm_eps, dtype=dtype)
        self.compressor = compressor
        self.indexer = (Indexer(dim=D, q_lora_rank=q, head_dim=d, n_heads=c.index_n_heads,
                                index_head_dim=c.index_head_dim, ratio=r,
                                owns_wk=role.attn_kind == "compressed" and role.is_kv_source,
                                v4_compressor=role.attn_kind == "csa", eps=c.rms_norm_eps, dtype=dtype)
                        if role.is_index_source else None)

    def queries(self, x_TD: jax.Array) -> tuple[jax.Array, jax.Array]:
        """qr [T, q_lora] (also the indexer's query input) and q [T, H, d] before RoPE (the serving runtime's
        fused attention rotates it itself)."""
        qr = self.q_norm(self.wq_a(x_TD))
        q = self.wq_b(qr).reshape(x_TD.shape[0], self.n_heads, self.head_dim)
        if self.q_head_norm:  # V4: unweighted per-head RMSNorm
            q = rms_norm(q, None, self.eps)
        return qr, q

    def project_q(self, x_TD: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
        """qr [T, q_lora] and RoPE'd q [T, H, d]."""
        qr, q = self.queries(x_TD)
        return qr, apply_rope(q, cos[:, None], sin[:, None])

    def project_kv(self, x_TD: jax.Array, cos: jax.Array, sin: jax.Array, fake_quant: bool) -> jax.Array:
        """SWA K=V rows [T, d]: RoPE'd, then (fake_quant) the FP8 record with a UE8M0 scale per 32."""
        kv = apply_rope(self.kv_norm(self.wkv(x_TD)), cos, sin)
        return fake_quant_fp8(kv) if fake_quant else kv

    def output(self, o_THd: jax.Array, cos: jax.Array, sin: jax.Array, out_dtype: jnp.dtype) -> jax.Array:
        """Inverse RoPE at the query position, then the output projection: [T, D]."""
        return self.project_out(apply_rope(o_THd, cos[:, None], sin[:, None], inverse=True), out_dtype)

    def project_out(self, o_THd: jax.Array, out_dtype: jnp.dtype) -> jax.Array:
        """wo_a per group of heads, then wo_b, of the attention output after its inverse RoPE: [T, D]."""
        T, G = o_THd.shape[0], self.o_groups
        w = self.wo_a.matrix()
        og = o_THd.astype(out_dtype).reshape(T, G, -1).astype(w.dtype)
        w_G = w.reshape(G, -1, og.shape[-1])
        mm = functools.partial(jnp.einsum, preferred_element_type=jnp.float32, precision=matmul_precision(w.dtype))
        # One batched product: what XLA partitions when the groups are split over tensor-parallel ranks, and on
        # XLA:CPU the faster form up to a few hundred rows (the per-group GEMMs copy each group's weight slice first:
        # peer, bf16, T 8: 0.23 vs 0.57 ms); at more rows one 2-D GEMM per group (T 512: 1.45 vs 1.9 ms). The same
        # bits in bfloat16; float32 sums in another order (they agree to rounding, tests/test_model.py).
        if _split_by_mesh() or T <= GROUPED_BATCHED_MAX_ROWS:
            z = mm("tgi,goi->tgo", og, w_G).reshape(T, -1)
        else:
            z = jnp.concatenate([mm("ti,oi->to", og[:, g], w_G[g]) for g in range(G)], axis=1)
        return self.wo_b(z.astype(out_dtype))


def _split_by_mesh() -> bool:
    """Whether this trace runs under a mesh with an automatically partitioned axis of more than one device."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and any(n > 1 and a not in mesh.manual_axes for a, n in mesh.shape.items())


def sparse_attention(q_THd: jax.Array, kv_Sd: jax.Array, swa_mask_TS: jax.Array, sink_H: jax.Array,
                     rows_Nd: jax.Array | None = None, rows_mask_TN: jax.Array | None = None) -> jax.Array:
    """Softmax over SWA rows and selected compressed rows plus a per-head sink logit; float32 [T, H, d].

    p_j = exp(s_j) / (exp(sink_h) + sum_k exp(s_k)), s = q . k / sqrt(d); the sink adds no value.
    """
    scale = q_THd.shape[-1] ** -0.5
    prec = jax.lax.Precision.HIGHEST
    q = q_THd.astype(jnp.float32)
    keys = [(kv_Sd.astype(jnp.float32), swa_mask_TS)]
    if rows_Nd is not None:
        keys.append((rows_Nd.astype(jnp.float32), rows_mask_TN))
    logits = [jnp.where(m[:, None, :], jnp.einsum("thd,sd->ths", q, k, precision=prec) * scale, -jnp.inf)
              for k, m in keys]
    probs, denom = sink_softmax(logits, sink_H)
    out = sum(jnp.einsum("ths,sd->thd", p, k, precision=prec) for p, (k, _) in zip(probs, keys))
    return out / denom


def sink_softmax(logits: list[jax.Array], sink_H: jax.Array) -> tuple[list[jax.Array], jax.Array]:
    """Unnormalised probabilities of several key blocks [.., H, K_i] sharing one softmax whose denominator
    also holds exp(sink_h) (the sink adds no value), and that denominator [.., H, 1]."""
    sink = jnp.broadcast_to(sink_H.astype(jnp.float32)[:, None], (*logits[0].shape[:-1], 1))
    m = jnp.max(jnp.concatenate([*logits, sink], axis=-1), axis=-1, keepdims=True)
    probs = [jnp.exp(s - m) for s in logits]
    return probs, jnp.exp(sink - m) + sum(jnp.sum(p, axis=-1, keepdims=True) for p in probs)
