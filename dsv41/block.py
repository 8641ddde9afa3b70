"""One block (mHC around attention and MoE, Engram before it) and the stream loop over a stack of blocks.

`run_blocks` owns the V4.1 delayed-pre carry (spec §2.3): each sublayer computes (pre, post, comb) from
its input streams but collapses them with the previous sublayer's pre-mix (identity = stream 0 for the
first), and a block's FFN output is only merged into the streams at the start of the next block, where
Engram is injected before the coefficients. V4 (delayed_pre=False) collapses with its own pre-mix.
The attention itself is a callback so the backbone (CED sharing) and DSpark (context rows) plug in.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41.config import LayerRole, ModelConfig
from dsv41.layers.attention import Attention
from dsv41.layers.basic import RMSNorm
from dsv41.layers.engram import Engram
from dsv41.layers.mhc import HcMix, HyperConnection, hc_collapse, hc_post
from dsv41.layers.moe import MoE


class Block(nnx.Module):
    def __init__(self, c: ModelConfig, role: LayerRole, *, dtype: jnp.dtype, n_experts: int, top_k: int,
                 engram_rows: int = 0, engram_fp8: bool = False):
        D, n = c.hidden_size, c.hc_mult
        self.role = role
        self.attn_norm = RMSNorm(D, c.rms_norm_eps, dtype=dtype)
        self.ffn_norm = RMSNorm(D, c.rms_norm_eps, dtype=dtype)
        self.attn = Attention(c, role, dtype=dtype)
        self.ffn = MoE(D, n_experts, top_k, c.moe_intermediate_size, c.routed_scaling_factor, c.swiglu_limit,
                       hash_vocab=c.vocab_size if role.hash_routed else None, dtype=dtype)
        hc = dict(sinkhorn_iters=c.hc_sinkhorn_iters, hc_eps=c.hc_eps, rms_eps=c.rms_norm_eps)
        self.hc_attn = HyperConnection(n, D, **hc)
        self.hc_ffn = HyperConnection(n, D, **hc)
        self.engram = (Engram(rows=engram_rows, n_cols=c.engram_hash_cols, head_dim=c.engram_head_dim, hc_mult=n,
                              dim=D, eps=c.rms_norm_eps, table_fp8=engram_fp8, dtype=dtype)
                       if role.engram_index is not None else None)


AttentionFn = Callable[[Block, jax.Array], jax.Array]  # (block, normed input [T, D]) -> output [T, D]


def run_blocks(blocks, c: ModelConfig, R_TnD: jax.Array, ids_T: jax.Array, attention: AttentionFn, *,
               engram_hashes: jax.Array | None = None, capture: tuple[int, ...] = ()
               ) -> tuple[jax.Array, jax.Array, dict[int, jax.Array]]:
    """Streams R [T, n, D] through `blocks`.

    Returns the final streams, the pre-mix of the final collapse [T, n] (the last FFN's in V4.1) and,
    for layer ids in `capture`, the mean over streams entering that layer (DSpark target features).
    """
    captured: dict[int, jax.Array] = {}
    pre: jax.Array | None = None
    pending: tuple[HcMix, jax.Array] | None = None  # V4.1: last FFN's (mix, output), merged lazily
    for block in blocks:
        role = block.role
        with jax.named_scope(f"layer_{role.layer_id}"):
            if pending is not None:
                R_TnD = hc_post(R_TnD, *pending)
            if role.layer_id in capture:
                captured[role.layer_id] = jnp.mean(R_TnD.astype(jnp.float32), axis=1)
            if block.engram is not None:
                if engram_hashes is None:
                    raise ValueError(f"layer {role.layer_id} has Engram: engram hash ids are required")
                R_TnD = block.engram(R_TnD, engram_hashes[:, role.engram_index])
            mix = block.hc_attn(R_TnD)
            if c.delayed_pre:
                u = R_TnD[:, 0] if pre is None else hc_collapse(R_TnD, pre)
            else:
                u = hc_collapse(R_TnD, mix.pre)
            with jax.named_scope("attn"):
                y = attention(block, block.attn_norm(u))
            R_TnD = hc_post(R_TnD, mix, y)
            pre = mix.pre
            mix = block.hc_ffn(R_TnD)
            u = hc_collapse(R_TnD, pre if c.delayed_pre else mix.pre)
            with jax.named_scope("moe"):
                y = block.ffn(block.ffn_norm(u), ids_T)
            pre = mix.pre
            if c.delayed_pre:
                pending = (mix, y)
            else:
                R_TnD = hc_post(R_TnD, mix, y)
    if pending is not None:
        R_TnD = hc_post(R_TnD, *pending)
    assert pre is not None, "run_blocks needs at least one block"
    return R_TnD, pre, captured
