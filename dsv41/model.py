"""The CED stack (spec §2-3) and its exact full-sequence forward.

`Transformer` is the NNX module tree; attribute paths mirror the release tensor names (`layers.3.attn.
wq_a.weight`; `layers.3.hc_attn.fn` <- `hc_attn_fn`). `forward` runs one sequence from position 0 through
every layer on every row. CED sharing (spec §3.1) is the `_Published` record threaded through the
layers: each KV source's global rows and index keys, each index source's top-k, the candidate blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41.block import Block, run_blocks
from dsv41.config import ModelConfig
from dsv41.dspark import DSpark
from dsv41.layers.attention import sparse_attention
from dsv41.layers.basic import Embed, Linear, RMSNorm
from dsv41.layers.indexer import causal_row_mask, select_candidate_blocks, select_topk, topk_row_mask
from dsv41.layers.mhc import HcHead, hc_collapse
from dsv41.layers.rope import apply_rope, inv_freq, rope_angles
from dsv41.quant import fake_quant_nvfp4


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
class _Published:
    """What a layer computes once and later layers read (CED sharing), keyed by the producing layer."""

    rows: dict[int, jax.Array] = field(default_factory=dict)  # KV source -> global KV rows [N, d]
    index_keys: dict[int, jax.Array] = field(default_factory=dict)  # KV source -> index keys [N, ihd]
    topk: dict[int, jax.Array] = field(default_factory=dict)  # index source -> row ids [T, k], -1 = none
    candidates: jax.Array | None = None  # [T, N] bool rows inside the candidate source's blocks


def window_mask(positions_T: jax.Array, window: int) -> jax.Array:
    """[T, T] bool: the query at p sees the SWA rows of positions max(p - window + 1, 0) .. p."""
    d = positions_T[:, None] - positions_T[None, :]
    return (d >= 0) & (d < window)


def _publish_kv_source(block: Block, x: jax.Array, pub: _Published, c: ModelConfig, fake_quant: bool,
                       frozen: dict | None) -> None:
    """Compressor latent -> global rows RoPE'd at each group's first position (+ NVFP4 record) and, from
    the same pre-RoPE latent (V4: from x through the indexer's own compressor), the index keys.
    `frozen[layer] = (rows, keys)` replaces the first rows (a prefix cache hit's rows, never rewritten)."""
    attn, role = block.attn, block.role
    assert attn.compressor is not None
    latent = attn.compressor(x)
    cos, sin = rope_angles(jnp.arange(latent.shape[0]) * role.compress_ratio, inv_freq(c, "compress"))
    rows = apply_rope(latent, cos, sin)
    rows = fake_quant_nvfp4(rows) if fake_quant else rows
    keys = None
    ix = attn.indexer
    if ix is not None and ix.wk is not None:
        keys = ix.keys(latent, cos, sin, fake_quant)
    elif ix is not None and ix.compressor is not None:
        keys = ix.keys(x, cos, sin, fake_quant)
    if frozen and role.layer_id in frozen:
        f_rows, f_keys = frozen[role.layer_id]
        rows = rows.at[: f_rows.shape[0]].set(f_rows.astype(rows.dtype))
        if f_keys is not None:  # V4's HCA sources have no index keys
            keys = keys.at[: f_keys.shape[0]].set(f_keys.astype(keys.dtype))
    pub.rows[role.layer_id] = rows
    if keys is not None:
        pub.index_keys[role.layer_id] = keys


def _selected_rows(block: Block, x: jax.Array, qr: jax.Array, positions: jax.Array, angles, pub: _Published,
                   c: ModelConfig, fake_quant: bool) -> jax.Array:
    """[T, N] bool: the global rows each query attends to (all visible rows for V4's HCA layers)."""
    role, r = block.role, block.role.compress_ratio
    n_rows = pub.rows[role.kv_source].shape[0]
    visible = causal_row_mask(positions, n_rows, r)
    if role.attn_kind == "hca":
        return visible
    if role.is_index_source:
        ix = block.attn.indexer
        cos, sin = angles[role.rope]
        s = ix.scores(x, qr, pub.index_keys[role.kv_source], cos, sin, fake_quant)
        s = jnp.where(visible, s, -jnp.inf)
        if role.is_candidate_source:
            pub.candidates = select_candidate_blocks(s, (positions + 1) // r, c.candidate_topk_blocks,
                                                     c.candidate_block_size)
        elif role.uses_candidates:
            s = jnp.where(pub.candidates, s, -jnp.inf)
        pub.topk[role.layer_id] = select_topk(s, c.index_topk)
    return topk_row_mask(pub.topk[role.index_source], n_rows) & visible


def _backbone_attention(c: ModelConfig, positions: jax.Array, pub: _Published, fake_quant: bool,
                        swa_floor: jax.Array | None = None, decoder_floor: jax.Array | None = None,
                        frozen: dict | None = None):
    angles = {kind: rope_angles(positions, inv_freq(c, kind)) for kind in ("main", "compress")
              if kind == "main" or c.rope_scaling is not None}
    swa = window_mask(positions, c.sliding_window)
    if swa_floor is not None:  # encoder replay: no SWA row below the query's floor, in every layer
        swa = swa & (positions[None, :] >= swa_floor[:, None])
    swa_after_cut = swa
    if decoder_floor is not None:  # decoder replay: layers after the cut see only kept rows
        swa_after_cut = swa & (positions[None, :] >= decoder_floor[:, None])

    def attend(block: Block, x: jax.Array) -> jax.Array:
        attn, role = block.attn, block.role
        cos, sin = angles[role.rope]
        qr, q = attn.project_q(x, cos, sin)
        kv = attn.project_kv(x, cos, sin, fake_quant)
        rows = rows_mask = None
        if role.attn_kind != "swa":
            if role.is_kv_source:
                _publish_kv_source(block, x, pub, c, fake_quant, frozen)
            if pub.rows[role.kv_source].shape[0]:
                rows = pub.rows[role.kv_source]
                rows_mask = _selected_rows(block, x, qr, positions, angles, pub, c, fake_quant)
        after_cut = c.cut_layer is not None and role.layer_id > c.cut_layer
        o = sparse_attention(q, kv, swa_after_cut if after_cut else swa, attn.attn_sink[...], rows, rows_mask)
        return attn.output(o, cos, sin, x.dtype)

    return attend


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
    attend = _backbone_attention(c, jnp.arange(ids_T.shape[0]), _Published(), fake_quant, swa_floor,
                                 decoder_floor, frozen)
    R, pre, captured = run_blocks(model.layers, c, _embed_streams(model, ids_T), ids_T, attend,
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
    pub = _Published()
    last = max(r.layer_id for r in c.roles if r.is_kv_source)
    run_blocks(model.layers[: last + 1], c, _embed_streams(model, ids_T), ids_T,
               _backbone_attention(c, jnp.arange(ids_T.shape[0]), pub, fake_quant), engram_hashes=engram_hashes)
    return {s: (pub.rows[s], pub.index_keys.get(s)) for s in pub.rows}
