"""DSpark drafter modules (spec §2.12), loaded from the release `mtp.*` tensors.

Stage tensors: `mtp.0.main_proj` [D, 3D] + `main_norm` combine the target features (mean of the streams
entering layers dspark_target_layer_ids); each stage `mtp.k` is a standard SWA-only block (theta
rope_theta, its own MoE); the last stage holds `norm`, `markov_head.{embed,head}` and
`confidence_head.proj`. Embed and head are the target's.

The drafting functions below are the reference of the module math. Positional details of the draft
window (which committed context rows a block position sees) are inferred from vLLM's speculator and are
marked so; speculative decoding itself belongs to the serving runtime.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41.block import Block, run_blocks
from dsv41.config import ModelConfig, dspark_role
from dsv41.layers.attention import draft_block_attention
from dsv41.layers.basic import Embed, Linear, RMSNorm
from dsv41.layers.mhc import hc_collapse
from dsv41.layers.rope import inv_freq, rope_angles


class DSpark(nnx.Module):
    def __init__(self, c: ModelConfig, *, dtype: jnp.dtype):
        D, V, r = c.hidden_size, c.vocab_size, c.dspark_markov_rank
        self.config = c
        self.main_proj = Linear(len(c.dspark_target_layer_ids) * D, D, dtype=dtype)
        self.main_norm = RMSNorm(D, c.rms_norm_eps, dtype=dtype)
        self.blocks = nnx.List([
            Block(c, dspark_role(c, k), dtype=dtype, n_experts=c.dspark_n_routed_experts,
                  top_k=c.dspark_num_experts_per_tok)
            for k in range(c.num_nextn_predict_layers)])
        self.norm = RMSNorm(D, c.rms_norm_eps, dtype=dtype)
        self.markov_embed = Embed(V, r, dtype=dtype)
        self.markov_head = Linear(r, V, dtype=dtype)
        self.confidence = Linear(D + r, 1, dtype=jnp.float32)

    def combine(self, features_TkD: jax.Array) -> jax.Array:
        """main_x [T, D] = main_norm(main_proj(concat of the target features [T, k, D]))."""
        x = features_TkD.reshape(features_TkD.shape[0], -1).astype(self.main_proj.dtype)
        return self.main_norm(self.main_proj(x))

    def context_kv(self, main_x_TD: jax.Array, positions_T: jax.Array, fake_quant: bool = False
                   ) -> list[jax.Array]:
        """Per stage, the SWA rows [T, d] of committed positions: RoPE(kv_norm(wkv(main_x))), theta main."""
        cos, sin = rope_angles(positions_T, inv_freq(self.config, "main"))
        return [blk.attn.project_kv(main_x_TD, cos, sin, fake_quant) for blk in self.blocks]

    def markov_bias(self, prev_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(markov embedding [.., r], logit bias [.., V]) of the previously drafted/emitted tokens."""
        e = self.markov_embed(prev_ids)
        return e, self.markov_head(e, jnp.float32)

    def confidence_prob(self, head_hidden_D: jax.Array, markov_e: jax.Array) -> jax.Array:
        x = jnp.concatenate([head_hidden_D.astype(jnp.float32), markov_e.astype(jnp.float32)], axis=-1)
        return jax.nn.sigmoid(self.confidence(x, jnp.float32)[..., 0])


def draft_hidden(dspark: DSpark, embed: Embed, block_ids_B: jax.Array, anchor_position: jax.Array,
                 context_kv: list[jax.Array], context_positions_C: jax.Array, *, fake_quant: bool = False
                 ) -> jax.Array:
    """Pre-norm head hidden [B, D] of one proposal block [anchor, noise x (B-1)].

    Block slot k sits at position anchor_position + k. Each slot attends to every slot of the block
    (non-causal) and to its stage's context rows at positions [anchor - window, anchor) (inferred).
    """
    c = dspark.config
    B = block_ids_B.shape[0]
    positions = anchor_position + jnp.arange(B)
    cos, sin = rope_angles(positions, inv_freq(c, "main"))
    ctx_visible = (context_positions_C < anchor_position) & (context_positions_C >= anchor_position - c.sliding_window)
    stage = {blk.role.layer_id: i for i, blk in enumerate(dspark.blocks)}

    def attention(block: Block, x: jax.Array) -> jax.Array:
        context = context_kv[stage[block.role.layer_id]]
        sink = block.attn.attn_sink[...]
        return block.attn.attend(x, cos, sin, lambda _, q, kv: draft_block_attention(q, kv, context, ctx_visible, sink),
                                 fake_quant=fake_quant)

    e = embed(block_ids_B)
    R = jnp.broadcast_to(e[:, None, :], (B, c.hc_mult, e.shape[1]))
    R, pre, _ = run_blocks(dspark.blocks, c, R, block_ids_B, attention)
    return hc_collapse(R, pre)


def draft_base_logits(dspark: DSpark, head: Linear, hidden_BD: jax.Array) -> jax.Array:
    """Base logits U [B, V] = head(norm(hidden)); slot k predicts the token after slot k."""
    return head(dspark.norm(hidden_BD), jnp.float32)

