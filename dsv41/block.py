"""One block (mHC around attention and MoE, Engram before it) and the stream loop over a stack of blocks.

`run_blocks` owns the V4.1 delayed-pre carry (spec §2.3): each sublayer computes (pre, post, comb) from
its input streams but collapses them with the previous sublayer's pre-mix (identity = stream 0 for the
first), and a block's FFN output is only merged into the streams at the start of the next block, where
Engram is injected before the coefficients. V4 (delayed_pre=False) collapses with its own pre-mix.
The attention itself is a callback so the backbone (CED sharing) and DSpark (context rows) plug in.

Where V4.1 merges a sublayer output, collapses with the delayed pre-mix and normalises the next sublayer's
input (before the FFN; before the next block's attention unless Engram sits in between), the three run as
one `pallas_kernels.mhc_post_pre` call under the implementation of the block's static `kernels` (see
`dsv41.layers.basic.with_kernels`);
"reference" is op for op the unfused code.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41.config import LayerRole, ModelConfig
from dsv41.layers.attention import Attention
from dsv41.layers.basic import RMSNorm
from dsv41.layers.engram import Engram, EngramRows
from dsv41.layers.mhc import HcMix, HyperConnection, hc_collapse, hc_post
from dsv41.layers.moe import MoE
from pallas_kernels.kernel_config import KernelConfig
from pallas_kernels.mhc import mhc_post_pre


class Block(nnx.Module):
    def __init__(self, c: ModelConfig, role: LayerRole, *, dtype: jnp.dtype, n_experts: int, top_k: int,
                 engram_rows: int = 0, engram_fp8: bool = False):
        D, n = c.hidden_size, c.hc_mult
        self.role = role
        # Fused ops of the block: mHC post + collapse + norm, and in the serving runtime the sparse attention
        # and the indexer's top-k (static; given by `dsv41.layers.basic.with_kernels`).
        self.kernels = KernelConfig()
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

    @property
    def kernel_impl(self) -> str:
        """The implementation of the block's fused ops (`kernels.impl`)."""
        return self.kernels.impl


AttentionFn = Callable[[Block, jax.Array], jax.Array]  # (block, normed input [T, D]) -> output [T, D]


class Streams(NamedTuple):
    """The residual streams between sublayers, with what V4.1 carries across the boundary."""

    R: jax.Array  # [T, n, D]
    pre: jax.Array | None  # [T, n] pre-mix for the next collapse (None before the first block)
    pending: tuple[HcMix, jax.Array] | None  # V4.1: the last FFN's (mix, output), merged lazily


def attention_input(block: Block, c: ModelConfig, s: Streams, engram_hashes: jax.Array | None = None
                    ) -> tuple[jax.Array, HcMix, jax.Array]:
    """Merge the pending FFN output, inject Engram, compute the attention mixes and collapse:
    (streams R [T, n, D], attention mix, normed attention input x [T, D])."""
    if c.delayed_pre and s.pending is not None and block.engram is None:
        mix_ffn, y = s.pending
        R, x = _post_collapse_norm(block, block.attn_norm, s.R, mix_ffn, y, s.pre)
        return R, block.hc_attn(R), x
    R = s.R if s.pending is None else hc_post(s.R, *s.pending)
    if block.engram is not None:
        if engram_hashes is None:
            raise ValueError(f"layer {block.role.layer_id} has Engram: engram hash ids are required")
        i = block.role.engram_index
        R = block.engram(R, engram_hashes.layer(i) if isinstance(engram_hashes, EngramRows) else engram_hashes[:, i])
    mix = block.hc_attn(R)
    if c.delayed_pre:
        u = R[:, 0] if s.pre is None else hc_collapse(R, s.pre)
    else:
        u = hc_collapse(R, mix.pre)
    return R, mix, block.attn_norm(u)


def ffn_and_output(block: Block, c: ModelConfig, R: jax.Array, mix: HcMix, y: jax.Array, ids_T: jax.Array,
                   valid_T: jax.Array | None = None) -> tuple[Streams, jax.Array]:
    """Write the attention output into the streams, run the FFN sublayer: the next Streams, and the MoE's
    expert choices [T, k] (for load counting; unused outputs cost nothing in a compiled graph). valid_T [T]: the
    rows the routed experts run on (`MoE.routed`; None: all)."""
    if c.delayed_pre:
        R, x = _post_collapse_norm(block, block.ffn_norm, R, mix, y, mix.pre)
        mix = block.hc_ffn(R)
    else:
        R = hc_post(R, mix, y)
        mix = block.hc_ffn(R)
        x = block.ffn_norm(hc_collapse(R, mix.pre))
    with jax.named_scope("moe"):
        y, choices_Tk = block.ffn.routed(x, ids_T, valid_T)
    if c.delayed_pre:
        return Streams(R, mix.pre, (mix, y)), choices_Tk
    return Streams(hc_post(R, mix, y), mix.pre, None), choices_Tk


def _post_collapse_norm(block: Block, norm: RMSNorm, R_TnD: jax.Array, mix: HcMix, y_TD: jax.Array,
                        pre_Tn: jax.Array) -> tuple[jax.Array, jax.Array]:
    """V4.1: (streams after writing y with `mix` [T, n, D], norm(collapse with the delayed pre_Tn) [T, D])."""
    with jax.named_scope("mhc_post_pre"):
        return mhc_post_pre(R_TnD, y_TD, mix.post, mix.comb, pre_Tn, norm.weight[...], eps=norm.eps,
                            impl=block.kernel_impl)


def final_streams(s: Streams) -> tuple[jax.Array, jax.Array]:
    """Streams after the last block, and the pre-mix of the final collapse (the last FFN's in V4.1)."""
    assert s.pre is not None, "no block has run"
    return (s.R if s.pending is None else hc_post(s.R, *s.pending)), s.pre


def mean_stream(s: Streams) -> jax.Array:
    """Mean over the streams entering the next block (after the pending merge): DSpark's target feature."""
    R = s.R if s.pending is None else hc_post(s.R, *s.pending)
    return jnp.mean(R.astype(jnp.float32), axis=1)


def run_blocks(blocks, c: ModelConfig, R_TnD: jax.Array, ids_T: jax.Array, attention: AttentionFn, *,
               engram_hashes: jax.Array | None = None, capture: tuple[int, ...] = ()
               ) -> tuple[jax.Array, jax.Array, dict[int, jax.Array]]:
    """Streams R [T, n, D] through `blocks`: the final streams, the final collapse's pre-mix [T, n] and,
    for layer ids in `capture`, the mean stream entering that layer (DSpark target features)."""
    s = Streams(R_TnD, None, None)
    captured: dict[int, jax.Array] = {}
    for block in blocks:
        with jax.named_scope(f"layer_{block.role.layer_id}"):
            if block.role.layer_id in capture:
                captured[block.role.layer_id] = mean_stream(s)
            R, mix, x = attention_input(block, c, s, engram_hashes)
            with jax.named_scope("attn"):
                y = attention(block, x)
            s, _ = ffn_and_output(block, c, R, mix, y, ids_T)
    R, pre = final_streams(s)
    return R, pre, captured
