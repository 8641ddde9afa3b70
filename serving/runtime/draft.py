"""The DSpark drafter against the runtime's cache (spec §2.12, serving §4.1).

Context: for every committed position, segment 2 writes each draft stage's SWA row RoPE(kv_norm(wkv(main_x)))
of main_x = main_norm(main_proj(target features)) into that stage's ring (`KVCache.draft[stage]`, a ring of
`window` rows per slot like the target's); the target features are the mean streams entering
`dspark_target_layer_ids`, which lie after the CED cut, so they exist for segment 2's kept rows - each
chunk's last `window` rows, exactly the rows a later draft reads (the drafter's window is the target's, so
decoder replay loses it nothing; spec serving §4.4). Rows of rejected drafts are rolled back with the
target's (serving.runtime.rollback).

Proposal: one parallel pass of the block [anchor, noise x (B - 1)] at positions anchor_pos .. + B - 1 through
the draft stages - every block slot sees every other (non-causal) and its stage's ring rows of positions
[anchor_pos - window, anchor_pos) - then the sequential Markov head: slot k's logits are the base logits plus
markov_head(markov_embed(prev)), prev being the anchor, then each drafted token. The same math as
`dsv41.dspark.draft_hidden` and the drafter's training (`dsv41.train.drafter`), batched over requests.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41.block import run_blocks
from dsv41.layers.attention import draft_blocks_attention
from dsv41.layers.mhc import hc_collapse
from dsv41.layers.rope import inv_freq, rope_angles
from serving.runtime.attention import write_ring
from serving.runtime.kv_cache import CacheLayout, KVCache
from serving.runtime.speculative import gumbel_argmax, row_keys


def write_context(dspark, layout: CacheLayout, cache: KVCache, features_TkD: jax.Array, pos_T: jax.Array,
                  slot_T: jax.Array, write_T: jax.Array, fake_quant: bool) -> KVCache:
    """Each draft stage's context rows of the rows `write_T` (target features [T, targets, D])."""
    main_x = dspark.combine(features_TkD)
    rows = dspark.context_kv(main_x, pos_T, fake_quant)
    return cache.updated(draft={i: write_ring(layout.swa_format, ring, rows[i], pos_T, slot_T, write_T)
                                for i, ring in cache.draft.items()})


def propose(module, layout: CacheLayout, cache: KVCache, anchor_R: jax.Array, anchor_pos_R: jax.Array,
            slot_R: jax.Array, floor_R: jax.Array, *, fake_quant: bool = False) -> tuple[jax.Array, jax.Array]:
    """The block pass for each request's anchor: (pre-norm head hidden [R, B, D], base logits [R, B, V] float32).
    Context rows below `floor_R` (replay_start) are not read."""
    c, ds = layout.config, module.dspark
    R, B, W = anchor_R.shape[0], c.dspark_block_size, layout.window
    block_pos = anchor_pos_R[:, None] + jnp.arange(B)[None]  # [R, B]
    ids = jnp.concatenate([anchor_R[:, None].astype(jnp.int32),
                           jnp.full((R, B - 1), c.dspark_noise_token_id, jnp.int32)], axis=1).reshape(-1)
    cos, sin = rope_angles(block_pos.reshape(-1), inv_freq(c, "main"))
    # ring row i of a slot holds the position p = i (mod W) in [anchor - W, anchor)
    ring_pos = anchor_pos_R[:, None] - W + (jnp.arange(W)[None] - anchor_pos_R[:, None]) % W
    ctx_ok = ring_pos >= jnp.maximum(floor_R, 0)[:, None]
    stage = {blk.role.layer_id: i for i, blk in enumerate(ds.blocks)}

    def attention(block, x):  # one block per request
        ring = layout.swa_format.decode(cache.draft[stage[block.role.layer_id]][slot_R])  # [R, W, d]
        sink = block.attn.attn_sink[...]
        return block.attn.attend(x, cos, sin, lambda _, q, kv: draft_blocks_attention(q, kv, ring, ctx_ok, sink),
                                 fake_quant=fake_quant)

    e = module.embed(ids)
    streams = jnp.broadcast_to(e[:, None, :], (R * B, c.hc_mult, e.shape[1]))
    out, pre, _ = run_blocks(ds.blocks, c, streams, ids, attention)
    h = hc_collapse(out, pre)
    base = module.head(ds.norm(h), jnp.float32)
    return h.reshape(R, B, -1), base.reshape(R, B, -1)


def markov_draft(ds, hidden_RBD: jax.Array, base_RBV: jax.Array, anchor_R: jax.Array, anchor_pos_R: jax.Array,
                 greedy_R: jax.Array, temperature_R: jax.Array, seed_R: jax.Array
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The sequential Markov head: (drafted tokens [R, B], the distributions q they were drawn from [R, B, V],
    the confidence head's per-slot probability [R, B]). Greedy rows (`greedy_R`) draft the argmax (q one-hot);
    the others draw from q = softmax(logits / temperature)."""
    B = base_RBV.shape[1]
    temp = jnp.where(greedy_R, 1.0, temperature_R)[:, None]
    sampled = jnp.any(~greedy_R)  # a greedy batch draws no noise
    prev, drafts, qs, confs = anchor_R.astype(jnp.int32), [], [], []
    for k in range(B):
        e, bias = ds.markov_bias(prev)
        logits = base_RBV[:, k] + bias
        confs.append(ds.confidence_prob(hidden_RBD[:, k], e))
        top = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        keys = row_keys(seed_R, anchor_pos_R + k + 1, 3)
        drawn = jax.lax.cond(sampled, lambda: gumbel_argmax(logits / temp, keys), lambda: top)
        tok = jnp.where(greedy_R, top, drawn)
        one_hot = jax.nn.one_hot(tok, logits.shape[-1], dtype=jnp.float32)
        qs.append(jax.lax.cond(sampled, lambda: jnp.where(greedy_R[:, None], one_hot,
                                                          jax.nn.softmax(logits / temp, axis=-1)), lambda: one_hot))
        drafts.append(tok)
        prev = tok
    return jnp.stack(drafts, 1), jnp.stack(qs, 1), jnp.stack(confs, 1)
