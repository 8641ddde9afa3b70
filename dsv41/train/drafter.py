"""DSpark training (spec §2.12): the drafter learns to draft a block of `dspark_block_size` tokens from the
frozen target's features, as it will at serving time.

For an anchor position p of a training sequence ids [T]:

* context: the drafter's SWA rows of positions [p - window, p), each RoPE(kv_norm(wkv(main_x))) of that
  position's target features (the mean streams entering `dspark_target_layer_ids`, `DSpark.combine`);
* block: [ids[p], noise x (B - 1)] at positions p .. p + B - 1, non-causal inside the block (as
  `dsv41.dspark.draft_hidden`, which this batches over anchors and checks against in a test);
* slot k predicts the token at p + k + 1. Its logits are the base logits head(norm(h_k)) plus the Markov
  bias markov_head(markov_embed(prev_k)), prev_k = ids[p + k] (the anchor, then teacher-forced tokens);
* losses: cross-entropy against the target's own distribution at p + k (distillation from the frozen
  target, which is what acceptance measures), the confidence head's binary cross-entropy against
  "the draft's argmax equals the target's argmax" (inputs stop-gradient: the head only reads), and the
  drafter MoE's sequence-wise balance loss; its loads drive the drafter routers' bias updates.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dsv41.config import ModelConfig
from dsv41.layers.attention import draft_blocks_attention
from dsv41.layers.rope import inv_freq, rope_angles
from dsv41.train.forward import sg, train_blocks


class DraftOut(NamedTuple):
    ce: jax.Array  # mean cross-entropy of the draft logits against the target's distributions
    confidence_bce: jax.Array
    balance: jax.Array
    loads: jax.Array  # [stages, E] int32
    accept_len: jax.Array  # mean teacher-forced accepted length per block (greedy match, 0..B)
    match_rate: jax.Array  # [B] per-slot greedy agreement with the target


def anchor_context(c: ModelConfig, anchors_A: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Context positions [A, window] before each anchor and whether they exist (>= 0)."""
    pos = anchors_A[:, None] - c.sliding_window + jnp.arange(c.sliding_window)[None, :]
    return jnp.maximum(pos, 0), pos >= 0


def draft_hidden_batch(model, ids_T: jax.Array, features_TkD: jax.Array, anchors_A: jax.Array,
                       moe_compute: str = "dense"):
    """Pre-norm head hidden [A, B, D] of the proposal blocks at `anchors` (positions <= T - B), the Markov
    embeddings of prev [A, B, r], and the drafter's MoE stats."""
    c: ModelConfig = model.config
    ds = model.dspark
    ids_T = jnp.asarray(ids_T)
    A, B = anchors_A.shape[0], c.dspark_block_size
    main_x = ds.combine(features_TkD)
    context = ds.context_kv(main_x, jnp.arange(ids_T.shape[0]))  # per stage [T, d]
    ctx_pos, ctx_ok = anchor_context(c, anchors_A)
    block_pos = anchors_A[:, None] + jnp.arange(B)[None, :]  # [A, B]
    block_ids = jnp.concatenate([ids_T[anchors_A][:, None],
                                 jnp.full((A, B - 1), c.dspark_noise_token_id, ids_T.dtype)], axis=1)
    cos, sin = rope_angles(block_pos.reshape(-1), inv_freq(c, "main"))
    stage = {blk.role.layer_id: i for i, blk in enumerate(ds.blocks)}

    def attention(block, x):  # one block per anchor
        rows, sink = context[stage[block.role.layer_id]][ctx_pos], block.attn.attn_sink[...]  # rows [A, W, d]
        return block.attn.attend(x, cos, sin, lambda _, q, kv: draft_blocks_attention(q, kv, rows, ctx_ok, sink))

    flat_ids = block_ids.reshape(-1)
    e = model.embed(flat_ids)
    R = jnp.broadcast_to(e[:, None, :], (A * B, c.hc_mult, e.shape[1]))
    h, _, stats = train_blocks(ds.blocks, c, R, flat_ids, attention, moe_compute=moe_compute)
    markov_e = ds.markov_embed(ids_T[block_pos])
    return h.reshape(A, B, -1), markov_e, stats


def draft_losses(model, ids_T: jax.Array, features_TkD: jax.Array, target_logits_TV: jax.Array,
                 anchors_A: jax.Array, moe_compute: str = "dense") -> DraftOut:
    """The drafter's losses over the anchors of one sequence (features and target logits: frozen target)."""
    c: ModelConfig = model.config
    ds = model.dspark
    B = c.dspark_block_size
    h, markov_e, stats = draft_hidden_batch(model, ids_T, sg(features_TkD), anchors_A, moe_compute)
    logits = model.head(ds.norm(h), jnp.float32) + ds.markov_head(markov_e, jnp.float32)  # [A, B, V]
    block_pos = anchors_A[:, None] + jnp.arange(B)[None, :]
    target = sg(target_logits_TV[block_pos])  # [A, B, V]: the target's distribution for the same token
    ce = -jnp.mean(jnp.sum(jax.nn.softmax(target, -1) * jax.nn.log_softmax(logits, -1), axis=-1))
    match = jnp.argmax(logits, -1) == jnp.argmax(target, -1)  # [A, B]
    conf_logit = ds.confidence(jnp.concatenate([sg(h), sg(markov_e).astype(h.dtype)], -1), jnp.float32)[..., 0]
    label = match.astype(jnp.float32)
    bce = jnp.mean(jnp.maximum(conf_logit, 0) - conf_logit * label + jnp.log1p(jnp.exp(-jnp.abs(conf_logit))))
    accept = jnp.sum(jnp.cumprod(match.astype(jnp.float32), axis=1), axis=1)
    return DraftOut(ce, bce, jnp.mean(jnp.stack([s.balance for s in stats])), jnp.stack([s.loads for s in stats]),
                    jnp.mean(accept), jnp.mean(label, axis=0))
