"""The CED stack (spec §2-3) and its exact full-sequence forward.

`Transformer` is the NNX module tree; attribute paths mirror the release tensor names (`layers.3.attn.
wq_a.weight`; `layers.3.hc_attn.fn` <- `hc_attn_fn`). `forward` runs one sequence from position 0 through
every layer on every row. CED sharing (spec §3.1) is the `Published` record threaded through the
layers (`backbone_attention`, also the trainer's): each KV source's global rows and index keys, each index
source's top-k, the candidate blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41.block import AttentionFn, Block, run_blocks
from dsv41.config import LayerRole, ModelConfig
from dsv41.dspark import DSpark
from dsv41.layers.attention import masked_attention, publish_kv_source
from dsv41.layers.basic import Embed, Linear, RMSNorm
from dsv41.layers.indexer import causal_row_mask, select_candidate_blocks, select_topk, topk_row_mask
from dsv41.layers.mhc import HcHead, hc_collapse
from dsv41.layers.rope import inv_freq, rope_angles


class Transformer(nnx.Module):
    def __init__(self, c: ModelConfig, *, dtype: jnp.dtype = jnp.float32, engram_fp8: bool = False):
        self.config = c
        D = c.hidden_size
        rows = dict(zip(c.engram_layer_ids, c.engram_num_embeddings))
        self.embed = Embed(c.vocab_size, D, dtype=dtype)
        self.layers = nnx.List([
            Block(c, role, dtype=dtype, n_experts=c.n_routed_experts, top_k=c.num_experts_per_tok,
                  engram_rows=rows.get(role.layer_id, 0), engram_fp8=engram_fp8)
            for role in c.roles])
        self.norm = RMSNorm(D, c.rms_norm_eps, dtype=dtype)
        self.head = Linear(D, c.vocab_size, dtype=dtype)
        self.hc_head = HcHead(c.hc_mult, D, hc_eps=c.hc_eps, rms_eps=c.rms_norm_eps) if c.hc_head else None
        self.dspark = DSpark(c, dtype=dtype) if c.family == "v41" and c.num_nextn_predict_layers else None


@dataclass
class Published:
    """What a layer computes once and later layers read (CED sharing), keyed by the producing layer."""

    rows: dict[int, jax.Array] = field(default_factory=dict)  # KV source -> global KV rows [N, d]
    index_keys: dict[int, jax.Array] = field(default_factory=dict)  # KV source -> index keys [N, ihd]
    topk: dict[int, jax.Array] = field(default_factory=dict)  # index source -> row ids [T, k], -1 = none
    candidates: jax.Array | None = None  # [T, N] bool rows inside the candidate source's blocks


# (role, RoPE'd q [T, H, d], SWA rows kv [T, d], sink [H], global rows [N, d] or None, their selected ids [T, k]
# (-1 = none; None: every visible row, V4's HCA)) -> float32 attention output [T, H, d]
OverKeys = Callable[[LayerRole, jax.Array, jax.Array, jax.Array, jax.Array | None, jax.Array | None], jax.Array]
# (indexer scores [T, N], q [T, H, d], global rows [N, d], visible [T, N] bool) at each index source
OnScores = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], None]


def window_mask(positions_T: jax.Array, window: int) -> jax.Array:
    """[T, T] bool: the query at p sees the SWA rows of positions max(p - window + 1, 0) .. p."""
    d = positions_T[:, None] - positions_T[None, :]
    return (d >= 0) & (d < window)


def backbone_attention(c: ModelConfig, positions_T: jax.Array, pub: Published, over_keys: OverKeys, *,
                       fake_quant: bool = False, frozen: dict | None = None, on_scores: OnScores | None = None
                       ) -> AttentionFn:
    """The backbone's attention callback (block, normed x [T, D]) -> [T, D] over one sequence from position 0,
    with CED sharing through `pub`: each KV source publishes its global rows and index keys, each index source its
    top-k (and the candidate source its blocks); `over_keys` attends over the layer's SWA rows and selected rows
    (`masked_keys` here, the trainer's banded form). `frozen[layer] = (rows, keys)` replaces a KV source's first
    rows (a prefix cache hit's, never rewritten); `on_scores` sees each index source's scores (the trainer's
    indexer loss)."""
    angles = {kind: rope_angles(positions_T, inv_freq(c, kind)) for kind in ("main", "compress")
              if kind == "main" or c.rope_scaling is not None}

    def attention(block: Block, x: jax.Array) -> jax.Array:
        attn, role = block.attn, block.role
        cos, sin = angles[role.rope]

        def over(qr: jax.Array, q: jax.Array, kv: jax.Array) -> jax.Array:
            rows = ids = None
            if role.attn_kind != "swa":
                if role.is_kv_source:
                    _publish(block, x, pub, c, fake_quant, frozen)
                if pub.rows[role.kv_source].shape[0]:
                    rows = pub.rows[role.kv_source]
                    if role.is_index_source:
                        _select(block, x, qr, q, positions_T, cos, sin, pub, c, fake_quant, on_scores)
                    ids = None if role.attn_kind == "hca" else pub.topk[role.index_source]
            return over_keys(role, q, kv, attn.attn_sink[...], rows, ids)

        return attn.attend(x, cos, sin, over, fake_quant=fake_quant)

    return attention


def _publish(block: Block, x: jax.Array, pub: Published, c: ModelConfig, fake_quant: bool, frozen: dict | None
             ) -> None:
    """KV source `block`: its global rows and index keys (V4: from its indexer's own compressor) into `pub`."""
    attn, role = block.attn, block.role
    ix = attn.indexer
    pooled = attn.compressor.pooled(x)
    index_pooled = ix.compressor.pooled(x) if ix is not None and ix.compressor is not None else None
    rows, keys = publish_kv_source(attn, c, pooled, jnp.arange(pooled.shape[0]), x.dtype, fake_quant,
                                   index_pooled_Nc=index_pooled)
    if frozen and role.layer_id in frozen:
        f_rows, f_keys = frozen[role.layer_id]
        rows = rows.at[: f_rows.shape[0]].set(f_rows.astype(rows.dtype))
        if f_keys is not None:  # V4's HCA sources have no index keys
            keys = keys.at[: f_keys.shape[0]].set(f_keys.astype(keys.dtype))
    pub.rows[role.layer_id] = rows
    if keys is not None:
        pub.index_keys[role.layer_id] = keys


def _select(block: Block, x: jax.Array, qr: jax.Array, q: jax.Array, positions: jax.Array, cos: jax.Array,
            sin: jax.Array, pub: Published, c: ModelConfig, fake_quant: bool, on_scores: OnScores | None) -> None:
    """Index source `block`: its top-k rows [T, k] (and at the candidate source the candidate blocks) into `pub`.
    The choice is an integer one: its inputs are constants to every gradient but `on_scores`'s."""
    role, r = block.role, block.role.compress_ratio
    sg = jax.lax.stop_gradient
    rows = pub.rows[role.kv_source]
    visible = causal_row_mask(positions, rows.shape[0], r)
    s = block.attn.indexer.scores(sg(x), sg(qr), pub.index_keys[role.kv_source], cos, sin, fake_quant)
    if on_scores is not None:
        on_scores(s, q, rows, visible)
    s = jnp.where(visible, sg(s), -jnp.inf)
    if role.is_candidate_source:
        pub.candidates = select_candidate_blocks(s, (positions + 1) // r, c.candidate_topk_blocks,
                                                 c.candidate_block_size)
    elif role.uses_candidates:
        s = jnp.where(pub.candidates, s, -jnp.inf)
    pub.topk[role.layer_id] = select_topk(s, c.index_topk)


def masked_keys(c: ModelConfig, positions_T: jax.Array, swa_floor: jax.Array | None = None,
                decoder_floor: jax.Array | None = None) -> OverKeys:
    """The exact attention over a layer's keys as [T, T] and [T, N] masks (`masked_attention`). `swa_floor` [T]
    clips every layer's SWA window from below (encoder replay), `decoder_floor` [T] the layers' after the CED
    cut (decoder replay)."""
    swa = window_mask(positions_T, c.sliding_window)
    if swa_floor is not None:  # encoder replay: no SWA row below the query's floor, in every layer
        swa = swa & (positions_T[None, :] >= swa_floor[:, None])
    swa_after_cut = swa
    if decoder_floor is not None:  # decoder replay: layers after the cut see only kept rows
        swa_after_cut = swa & (positions_T[None, :] >= decoder_floor[:, None])

    def over_keys(role: LayerRole, q, kv, sink, rows, ids):
        rows_mask = None
        if rows is not None:
            rows_mask = causal_row_mask(positions_T, rows.shape[0], role.compress_ratio)
            if ids is not None:
                rows_mask = topk_row_mask(ids, rows.shape[0]) & rows_mask
        after_cut = c.cut_layer is not None and role.layer_id > c.cut_layer
        return masked_attention(q, kv, swa_after_cut if after_cut else swa, sink, rows, rows_mask)

    return over_keys


def _embed_streams(model: Transformer, ids_T: jax.Array) -> jax.Array:
    e = model.embed(ids_T)
    return jnp.broadcast_to(e[:, None, :], (e.shape[0], model.config.hc_mult, e.shape[1]))


def forward_hidden(model: Transformer, ids_T: jax.Array, engram_hashes: jax.Array | None = None, *,
                   fake_quant: bool = False, capture: tuple[int, ...] = (), swa_floor: jax.Array | None = None,
                   decoder_floor: jax.Array | None = None, frozen: dict | None = None
                   ) -> tuple[jax.Array, dict[int, jax.Array]]:
    """Final hidden state [T, D] (after the output norm) and the captured layer inputs.

    The bounded-replay semantics (spec §3.3-3.4) are masks: `swa_floor` [T] clips every layer's SWA
    window from below (encoder replay), `decoder_floor` [T] clips the layers after the CED cut (decoder
    replay), `frozen` {KV source: (rows, index keys)} pins the rows a prefix-cache hit holds.
    """
    c = model.config
    positions = jnp.arange(ids_T.shape[0])
    attention = backbone_attention(c, positions, Published(), masked_keys(c, positions, swa_floor, decoder_floor),
                                   fake_quant=fake_quant, frozen=frozen)
    R, pre, captured = run_blocks(model.layers, c, _embed_streams(model, ids_T), ids_T, attention,
                                  engram_hashes=engram_hashes, capture=capture)
    h = model.hc_head(R) if model.hc_head is not None else hc_collapse(R, pre)
    return model.norm(h), captured


def forward(model: Transformer, ids_T: jax.Array, engram_hashes: jax.Array | None = None, *,
            fake_quant: bool = False, **masks) -> jax.Array:
    """Exact full-sequence logits [T, vocab] (float32); `masks` as in `forward_hidden`."""
    h, _ = forward_hidden(model, ids_T, engram_hashes, fake_quant=fake_quant, **masks)
    return model.head(h, jnp.float32)


def published_rows(model: Transformer, ids_T: jax.Array, engram_hashes: jax.Array | None = None, *,
                   fake_quant: bool = False) -> dict[int, tuple[jax.Array, jax.Array | None]]:
    """{KV source: (global rows, index keys or None)} of a cold full-sequence pass (what a prefix cache holds):
    only the layers up to the last KV source run."""
    c = model.config
    pub = Published()
    last = max(r.layer_id for r in c.roles if r.is_kv_source)
    positions = jnp.arange(ids_T.shape[0])
    run_blocks(model.layers[: last + 1], c, _embed_streams(model, ids_T), ids_T,
               backbone_attention(c, positions, pub, masked_keys(c, positions), fake_quant=fake_quant),
               engram_hashes=engram_hashes)
    return {s: (pub.rows[s], pub.index_keys.get(s)) for s in pub.rows}
