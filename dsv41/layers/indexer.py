"""Lightning indexer (spec §2.7): which compressed rows each query attends to.

Score S(t, j) = sum_h w[t, h] * ReLU(q[t, h] . k[j]) with w = weights_proj(x) / sqrt(index_head_dim *
index_n_heads); rows j >= (t + 1) // ratio are in the future. Each query keeps its top `index_topk` rows.

V4.1 splits the indexer: KV sources own `wk`/`k_norm` and turn their compressor latent into index keys;
every index source owns a query (`wq_b`, `weights_proj`) and scores against its KV source's keys; the
candidate source additionally publishes the best `candidate_topk_blocks` blocks of `candidate_block_size`
rows (block score = max, newest block pinned), and later index sources score only inside them.
V4 (compat): each ratio-4 layer's indexer has its own overlapping compressor at `index_head_dim`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41.layers.basic import Linear, RMSNorm
from dsv41.layers.compressor import V4Compressor
from dsv41.layers.rope import apply_rope
from dsv41.quant import fake_quant_mxfp4


class Indexer(nnx.Module):
    """wq_b [ih*ihd, q_lora], weights_proj [ih, D]; V4.1 KV sources add wk [ihd, d], k_norm [ihd];
    V4 adds its own `compressor`."""

    def __init__(self, *, dim: int, q_lora_rank: int, head_dim: int, n_heads: int, index_head_dim: int,
                 ratio: int, owns_wk: bool, v4_compressor: bool, eps: float, dtype: jnp.dtype):
        self.n_heads, self.head_dim, self.ratio = n_heads, index_head_dim, ratio
        self.wq_b = Linear(q_lora_rank, n_heads * index_head_dim, dtype=dtype)
        self.weights_proj = Linear(dim, n_heads, dtype=dtype)
        self.wk = Linear(head_dim, index_head_dim, dtype=dtype) if owns_wk else None
        self.k_norm = RMSNorm(index_head_dim, eps, dtype=dtype) if owns_wk else None
        self.compressor = (V4Compressor(dim, index_head_dim, ratio, overlap=True, eps=eps, dtype=dtype)
                           if v4_compressor else None)

    def keys(self, latent_Nd: jax.Array, cos: jax.Array, sin: jax.Array, fake_quant: bool) -> jax.Array:
        """V4.1 index keys [N, ihd] (float32) of a KV source's pre-RoPE compressor latent [N, d], at the rows'
        group-start angles cos/sin [N, d_r/2] (V4's come from its own compressor: `publish_kv_source`)."""
        assert self.wk is not None and self.k_norm is not None, "only KV-source indexers own wk"
        return self.rotate_keys(self.k_norm(self.wk(latent_Nd, jnp.float32)), cos, sin, fake_quant)

    @staticmethod
    def rotate_keys(k_Nc: jax.Array, cos: jax.Array, sin: jax.Array, fake_quant: bool) -> jax.Array:
        """Normed pre-RoPE keys -> the stored index keys (float32; MXFP4 fake-quant when asked)."""
        k = apply_rope(k_Nc.astype(jnp.float32), cos, sin)
        return fake_quant_mxfp4(k) if fake_quant else k

    def queries(self, x_TD: jax.Array, qr_Tq: jax.Array, cos: jax.Array, sin: jax.Array, fake_quant: bool
                ) -> tuple[jax.Array, jax.Array]:
        """RoPE'd index queries [T, ih, ihd] and head weights [T, ih] (float32) at angles cos/sin [T, d_r/2]."""
        q = self.wq_b(qr_Tq, jnp.float32).reshape(-1, self.n_heads, self.head_dim)
        q = apply_rope(q, cos[:, None], sin[:, None])
        if fake_quant:
            q = fake_quant_mxfp4(q)
        w = self.weights_proj(x_TD, jnp.float32) * (self.head_dim ** -0.5 * self.n_heads ** -0.5)
        return q, w

    def scores(self, x_TD: jax.Array, qr_Tq: jax.Array, keys_Nk: jax.Array, cos: jax.Array, sin: jax.Array,
               fake_quant: bool) -> jax.Array:
        """S [T, N] float32 for query angles cos/sin [T, d_r/2] (no causal mask applied)."""
        q, w = self.queries(x_TD, qr_Tq, cos, sin, fake_quant)
        return index_scores(q, w, keys_Nk)


def index_scores(q_Thc: jax.Array, w_Th: jax.Array, keys_Nc: jax.Array) -> jax.Array:
    """sum_h w[t, h] * ReLU(q[t, h] . k[n]) -> [T, N] (keys may carry a leading per-query axis [T, N, c])."""
    eq = "thc,tnc->thn" if keys_Nc.ndim == 3 else "thc,nc->thn"
    s = jnp.einsum(eq, q_Thc, keys_Nc.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return jnp.einsum("thn,th->tn", jax.nn.relu(s), w_Th, precision=jax.lax.Precision.HIGHEST)


def causal_row_mask(positions_T: jax.Array, n_rows: int, ratio: int) -> jax.Array:
    """[T, N] bool: compressed row j is visible to the query at position p iff j < (p + 1) // ratio."""
    return jnp.arange(n_rows)[None, :] < ((positions_T + 1) // ratio)[:, None]


def select_topk(scores_TN: jax.Array, k: int) -> jax.Array:
    """Top-k row indices [T, min(k, N)], -1 where fewer than k rows have a finite score.

    `scores` already holds -inf on masked rows. lax.top_k breaks ties by the lower index, and the
    indices are consumed whole (never sliced) so XLA keeps its TopK custom call instead of a full sort.
    """
    k = min(k, scores_TN.shape[-1])
    vals, idx = jax.lax.top_k(scores_TN, k)
    return jnp.where(vals == -jnp.inf, -1, idx)


def topk_row_mask(idx_Tk: jax.Array, n_rows: int) -> jax.Array:
    """[T, N] bool from top-k indices (-1 entries select nothing)."""
    safe = jnp.where(idx_Tk < 0, n_rows, idx_Tk)
    hit = jnp.zeros((idx_Tk.shape[0], n_rows + 1), jnp.bool_)
    hit = hit.at[jnp.arange(idx_Tk.shape[0])[:, None], safe].set(True)
    return hit[:, :n_rows]


def select_candidate_blocks(scores_TN: jax.Array, visible_T: jax.Array, topk_blocks: int, block_size: int
                            ) -> jax.Array:
    """Two-level selection at the candidate source: [T, N] bool mask of rows inside the chosen blocks.

    Blocks of `block_size` consecutive rows are scored by their max visible score; each query's newest
    (possibly partial) block is pinned (+inf); the top `topk_blocks` blocks are kept. With no more
    visible blocks than `topk_blocks` every visible row is a candidate (a no-op).
    """
    T, N = scores_TN.shape
    nb = -(-N // block_size)
    padded = jnp.pad(scores_TN, ((0, 0), (0, nb * block_size - N)), constant_values=-jnp.inf)
    block_scores = jnp.max(padded.reshape(T, nb, block_size), axis=-1)
    n_valid = -(-visible_T // block_size)  # blocks holding at least one visible row
    block_ids = jnp.arange(nb)[None, :]
    block_scores = jnp.where(block_ids < n_valid[:, None], block_scores, -jnp.inf)
    block_scores = jnp.where(block_ids == (n_valid - 1)[:, None], jnp.inf, block_scores)
    chosen = select_topk(block_scores, topk_blocks)  # [T, min(K, nb)]
    chosen_mask = topk_row_mask(chosen, nb)  # [T, nb]
    return jnp.repeat(chosen_mask, block_size, axis=1)[:, :N]
