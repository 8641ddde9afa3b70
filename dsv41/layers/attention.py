"""Attention block of every layer (spec §2.5): one shared K=V latent per token, attention sink, inverse
RoPE on the output and a grouped low-rank output projection.

Keys of the query at position p: its own layer's SWA rows (positions max(p - W + 1, 0) .. p, self included)
plus, in compressed layers, the global rows its index source selected. K and V are the same 512-d vector
(value channels include the rotated RoPE slice, which the inverse RoPE on the output undoes).

What every caller shares, once here:
  `Attention.attend`      the sublayer around a caller's key set: projections, RoPE, inverse RoPE, output;
                          the model, the trainer, the DSpark reference, its trainer and the runtime's proposal
                          (the paged runtime's fused op does the RoPE itself: it calls the projections alone)
  `masked_attention`      the sink softmax over dense keys under masks (the model's exact form; the serving
                          runtime's `paged_attention` is the fused op over the same keys in its paged cache)
  `draft_block_attention` a DSpark block over its context rows and itself (`draft_blocks_attention`: many)
  `publish_kv_source`     a KV source's global rows and index keys from its pooled compressor rows (the
                          model, the trainer, and the runtime's paged writers, which add the paging)
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41.config import LayerRole, ModelConfig
from dsv41.layers.basic import Linear, RMSNorm, matmul_precision, rms_norm
from dsv41.layers.compressor import Compressor, V4Compressor
from dsv41.layers.indexer import Indexer
from dsv41.layers.rope import apply_rope, inv_freq, rope_angles
from dsv41.quant import fake_quant_fp8, fake_quant_nvfp4
from pallas_kernels.common import sink_softmax  # the fused ops' own: one softmax-with-sink for model and kernels


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

    def attend(self, x_TD: jax.Array, cos: jax.Array, sin: jax.Array,
               over_keys: Callable[[jax.Array, jax.Array, jax.Array], jax.Array], *, fake_quant: bool = False
               ) -> jax.Array:
        """The sublayer [T, D] of x [T, D] at angles cos/sin [T, d_r/2] around a caller's key set:
        `over_keys(qr [T, q_lora], RoPE'd q [T, H, d], this step's RoPE'd K=V rows kv [T, d])` attends q over the
        keys the caller holds (kv among them) to a float32 [T, H, d]; then the inverse RoPE and the output
        projection."""
        qr, q = self.project_q(x_TD, cos, sin)
        kv = self.project_kv(x_TD, cos, sin, fake_quant)
        return self.output(over_keys(qr, q, kv), cos, sin, x_TD.dtype)

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
        # XLA:CPU the faster form up to a few hundred rows (the per-group GEMMs copy each group's weight slice
        # first); at more rows one 2-D GEMM per group (docs/design/measurements.md). The same bits in bfloat16;
        # float32 sums in another order (they agree to rounding, tests/test_model.py).
        if _split_by_mesh() or T <= GROUPED_BATCHED_MAX_ROWS:
            z = mm("tgi,goi->tgo", og, w_G).reshape(T, -1)
        else:
            z = jnp.concatenate([mm("ti,oi->to", og[:, g], w_G[g]) for g in range(G)], axis=1)
        return self.wo_b(z.astype(out_dtype))


def _split_by_mesh() -> bool:
    """Whether this trace runs under a mesh with an automatically partitioned axis of more than one device."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and any(n > 1 and a not in mesh.manual_axes for a, n in mesh.shape.items())


def masked_attention(q_THd: jax.Array, kv_Sd: jax.Array, swa_mask_TS: jax.Array, sink_H: jax.Array,
                     rows_Nd: jax.Array | None = None, rows_mask_TN: jax.Array | None = None) -> jax.Array:
    """Softmax over dense keys under masks - SWA rows kv [S, d] (mask [T, S]) and compressed rows [N, d]
    (mask [T, N]) - plus a per-head sink logit; float32 [T, H, d]. Every argument but the sink may carry the
    same leading axes: independent sequences (the drafter's blocks).

    p_j = exp(s_j) / (exp(sink_h) + sum_k exp(s_k)), s = q . k / sqrt(d); the sink adds no value.
    """
    scale = q_THd.shape[-1] ** -0.5
    prec = jax.lax.Precision.HIGHEST
    q = q_THd.astype(jnp.float32)
    keys = [(kv_Sd.astype(jnp.float32), swa_mask_TS)]
    if rows_Nd is not None:
        keys.append((rows_Nd.astype(jnp.float32), rows_mask_TN))
    logits = [jnp.where(m[..., :, None, :], jnp.einsum("...thd,...sd->...ths", q, k, precision=prec) * scale,
                        -jnp.inf) for k, m in keys]
    probs, denom = sink_softmax(logits, sink_H)
    out = sum(jnp.einsum("...ths,...sd->...thd", p, k, precision=prec) for p, (k, _) in zip(probs, keys))
    return out / denom


def draft_block_attention(q_BHd: jax.Array, kv_Bd: jax.Array, context_Cd: jax.Array, context_ok_C: jax.Array,
                          sink_H: jax.Array) -> jax.Array:
    """One DSpark block's attention (spec §2.12), float32 [B, H, d]: each of its B slots sees every slot of the
    block (non-causal, kv [B, d]) and the context rows [C, d] where context_ok_C. Every argument but the sink may
    carry the same leading axes: many blocks at once (`draft_blocks_attention`)."""
    B, C, lead = kv_Bd.shape[-2], context_Cd.shape[-2], context_ok_C.shape[:-1]
    keys = jnp.concatenate([context_Cd.astype(kv_Bd.dtype), kv_Bd], axis=-2)
    mask = jnp.concatenate([jnp.broadcast_to(context_ok_C[..., None, :], (*lead, B, C)),
                            jnp.ones((*lead, B, B), jnp.bool_)], axis=-1)
    return masked_attention(q_BHd, keys, mask, sink_H)


def draft_blocks_attention(q_NHd: jax.Array, kv_Nd: jax.Array, context_ACd: jax.Array, context_ok_AC: jax.Array,
                           sink_H: jax.Array) -> jax.Array:
    """`draft_block_attention` of A blocks at once (the trainer's anchors, the runtime's requests), float32
    [N, H, d]: the N rows are the blocks' slots in order (block a: rows a * N/A ..), block a over context_ACd[a]."""
    A = context_ACd.shape[0]
    o = draft_block_attention(q_NHd.reshape(A, -1, *q_NHd.shape[1:]), kv_Nd.reshape(A, -1, kv_Nd.shape[-1]),
                              context_ACd, context_ok_AC, sink_H)
    return o.reshape(q_NHd.shape)


def publish_kv_source(attn: Attention, c: ModelConfig, pooled_Nd: jax.Array, row_ids_N: jax.Array,
                      out_dtype: jnp.dtype, fake_quant: bool, *, index_pooled_Nc: jax.Array | None = None
                      ) -> tuple[jax.Array, jax.Array | None]:
    """A KV source's global rows [N, d] and index keys [N, ihd] (None where it has no indexer keys) from its
    compressor's pooled float32 rows [N, d] (before the norm) with row ids j [N] (spec §2.6-2.7): latent =
    norm(pooled); row = RoPE(latent) at position j * ratio (NVFP4 fake-quant when asked); V4.1 keys from the same
    pre-RoPE latent (`Indexer.keys`), V4's from its indexer's own compressor, pooled as `index_pooled_Nc`.

    The keys only select rows, an integer choice, so no gradient reaches the latent through them (the trainer's
    indexer loss trains wk / k_norm alone). Pooling is the caller's: a sequence from position 0 here, chunks
    with carried tails or windows in the paged runtime."""
    latent = attn.compressor.norm(pooled_Nd, out_dtype)
    cos, sin = rope_angles(row_ids_N * attn.compressor.ratio, inv_freq(c, "compress"))
    rows = apply_rope(latent, cos, sin)
    rows = fake_quant_nvfp4(rows) if fake_quant else rows
    ix, keys = attn.indexer, None
    if ix is not None and ix.wk is not None:
        keys = ix.keys(jax.lax.stop_gradient(latent), cos, sin, fake_quant)
    elif ix is not None and ix.compressor is not None:
        keys = ix.rotate_keys(ix.compressor.norm(index_pooled_Nc, out_dtype), cos, sin, fake_quant)
    return rows, keys
