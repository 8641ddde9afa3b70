"""The two CED prefill segments, separate jitted functions over the flattened parameter leaves.

segment 1  every row of the step: embedding, layers 0 .. cut-1, then the cut layer up to its KV path
           (mHC + attn_norm, SWA rows, global rows + index keys written to the cache).
segment 2  the kept rows (all of them with replay off; each prefill's last `window` rows with decoder
           replay on; decode rows always): the rest of the cut layer - queries, indexer and candidates,
           attention, its SWA ring write - and layers cut+1 .. L-1, then the logits of each request's
           last row, and (under a cond, when a chunk asks) every kept row's next-token logprobs. Its
           shapes are its own row buckets, so trimming costs no recompilation.
Decode steps run through the same two functions with every row kept.

With `expert_counts` each segment also returns the per-expert token counts of the MoE layers it ran
([cut, E] and [L - cut, E] int32, valid rows only: segment 2's are the kept rows, the rows those layers
compute), for the expert load balancer; otherwise None.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from dsv41.block import Streams, attention_input, ffn_and_output, final_streams
from dsv41.layers.expert_load import count_experts
from dsv41.layers.mhc import HcMix, hc_collapse
from dsv41.layers.rope import inv_freq, rope_angles
from serving.runtime import global_kv
from pallas_kernels import resolve_impl
from serving.runtime.attention import Tiles, attention, flat_band, fused_attention, gathered_band, write_ring
from serving.runtime.decoder_replay import gather_kept
from serving.runtime.global_kv import TokenMeta
from serving.runtime.kv_cache import CacheLayout
from serving.runtime.sampling_params import MAX_LOGPROBS

REQ_KEYS = ("slot", "start", "end", "first", "qlen", "kv_floor", "write_floor", "dec_floor", "kept_first",
            "kept_qlen", "logit_row", "block_table", "valid", "sample")


def _req(b: dict) -> dict:
    return {k: b[f"req_{k}"] for k in REQ_KEYS}


def _tiles(b: dict, req: dict, first: str, qlen: str, floor: str, size: int) -> Tiles:
    return Tiles(b["tile_req"], b["tile_first"], b["tile_n"], req[first], req[qlen], req["start"], req["slot"],
                 req[floor], req["block_table"], size)


class _Layer:
    """Runs one block's attention sublayer against the cache and threads what layers publish."""

    def __init__(self, layout: CacheLayout, fake_quant: bool, n_iter: jax.Array):
        self.layout, self.fake_quant, self.n_iter = layout, fake_quant, n_iter
        self.topk: dict[int, jax.Array] = {}
        self.candidates: jax.Array | None = None

    def attend(self, block, x: jax.Array, ids_meta: TokenMeta, req: dict, tiles: Tiles, cache: dict, band=None,
               kv: jax.Array | None = None) -> tuple[jax.Array, dict]:
        layout, c, role, attn = self.layout, self.layout.config, block.role, block.attn
        cos, sin = rope_angles(ids_meta.pos, inv_freq(c, role.rope))
        qr, q = attn.project_q(x, cos, sin)
        if kv is None:
            kv = attn.project_kv(x, cos, sin, self.fake_quant)
            if role.is_kv_source:
                cache = global_kv.publish_source(layout, block, x, ids_meta, req, cache, self.fake_quant)
        rows_cache = topk = None
        rpb = 0
        if role.attn_kind == "compressed":
            r = role.compress_ratio
            if role.is_index_source:
                qi, wi = attn.indexer.queries(x, qr, cos, sin, self.fake_quant)
                keys_cache = cache["keys"][role.kv_source]
                if role.uses_candidates:
                    self.topk[role.layer_id] = global_kv.candidate_topk(
                        layout, qi, wi, ids_meta.pos, tiles, keys_cache, self.candidates, ratio=r)
                else:
                    self.topk[role.layer_id], cand = global_kv.dense_topk(
                        layout, attn.indexer, qi, wi, ids_meta.pos, tiles, keys_cache, self.n_iter[r - 1], ratio=r,
                        candidates=role.is_candidate_source)
                    if role.is_candidate_source:
                        self.candidates = cand
            topk, rows_cache = self.topk[role.index_source], cache["rows"][role.kv_source]
            rpb = layout.rows_per_block(role.kv_source)
        if band is None and resolve_impl(block.kernel_impl) == "pallas":
            o = fused_attention(layout, tiles, q, ids_meta.pos, ids_meta.req, kv, cache["swa"][role.layer_id],
                                attn.attn_sink[...], rows_cache=rows_cache, topk_Tk=topk)
        else:
            band = band or flat_band(kv, ids_meta.pos, tiles, layout.window)
            o = attention(layout, tiles, q, ids_meta.pos, band, cache["swa"][role.layer_id], attn.attn_sink[...],
                          rows_cache=rows_cache, topk_Tk=topk, rows_per_block=rpb)
        last_rows = ids_meta.valid & (ids_meta.pos >= req["end"][ids_meta.req] - layout.window)
        cache = {**cache, "swa": {**cache["swa"], role.layer_id: write_ring(
            layout, cache["swa"][role.layer_id], kv, ids_meta.pos, req["slot"][ids_meta.req], last_rows)}}
        return attn.output(o, cos, sin, x.dtype), cache


def _counting(on: bool, valid_T: jax.Array):
    return count_experts(valid_T) if on else contextlib.nullcontext()


def _stacked(counts: list | None, module) -> jax.Array | None:
    """[layers, E] int32 of the collected counts (None when not collecting)."""
    if counts is None:
        return None
    return jnp.stack(counts) if counts else jnp.zeros((0, module.layers[0].ffn.n_experts), jnp.int32)


def segment1(module, layout: CacheLayout, cache: dict, carry_buf: dict, b: dict, *, tile: int, fake_quant: bool,
             expert_counts: bool = False) -> tuple[dict, dict, jax.Array | None]:
    """(cache, carry rows in `carry_buf`, expert counts of layers 0 .. cut-1 [cut, E] or None)."""
    c, cut = layout.config, layout.config.cut_layer
    req = _req(b)
    meta = TokenMeta(b["pos"], b["req"], b["valid"])
    tiles = _tiles(b, req, "first", "qlen", "kv_floor", tile)
    layer = _Layer(layout, fake_quant, b["n_iter"])
    e = module.embed(b["ids"])
    s = Streams(jnp.broadcast_to(e[:, None, :], (e.shape[0], c.hc_mult, e.shape[1])), None, None)
    with _counting(expert_counts, b["valid"]) as counts:
        for block in module.layers[:cut]:
            with jax.named_scope(f"layer_{block.role.layer_id}"):
                R, mix, x = attention_input(block, c, s, b.get("engram"))
                with jax.named_scope("attn"):
                    y, cache = layer.attend(block, x, meta, req, tiles, cache)
                s = ffn_and_output(block, c, R, mix, y, b["ids"])
    counts = _stacked(counts, module)
    block = module.layers[cut]
    with jax.named_scope(f"layer_{cut}_kv_path"):
        R, mix, x = attention_input(block, c, s, b.get("engram"))
        cos, sin = rope_angles(meta.pos, inv_freq(c, block.role.rope))
        kv = block.attn.project_kv(x, cos, sin, fake_quant)
        if block.role.is_kv_source:
            cache = global_kv.publish_source(layout, block, x, meta, req, cache, fake_quant)
    carry = {"R": R, "x": x, "pre": mix.pre, "post": mix.post, "comb": mix.comb, "kv": kv, "ids": b["ids"],
             "pos": b["pos"], "req": b["req"], "topk": layer.topk, "candidates": layer.candidates}
    carry = {n: v for n, v in carry.items() if v is not None}
    if carry_buf is None:  # shape probe: the carry of this bucket
        return cache, carry, counts
    # Rows [0, T) of the persistent max-size buffer: segment 2's input shapes then depend on its own bucket only.
    return cache, jax.tree.map(lambda buf, a: jax.lax.dynamic_update_slice_in_dim(buf, a.astype(buf.dtype), 0, 0),
                               carry_buf, carry), counts


def segment2(module, layout: CacheLayout, cache: dict, carry_buf: dict, b: dict, *, tile: int, fake_quant: bool,
             expert_counts: bool = False) -> tuple[dict, jax.Array, tuple, jax.Array | None]:
    """(cache, logits of each request's last row [max_num_seqs, V], row logprobs of every kept row: next-token
    logprob [T2] and top ids / logprobs [T2, MAX_LOGPROBS] - zeros unless a chunk asked for them - and the
    expert counts of layers cut .. L-1 over the kept rows [L - cut, E] or None)."""
    c, cut = layout.config, layout.config.cut_layer
    carry = gather_kept(carry_buf, b, window=layout.window, tile=tile)
    req = _req(b)
    meta = TokenMeta(carry["pos"], carry["req"], b["valid"])
    size = tile
    layer = _Layer(layout, fake_quant, b["n_iter"])
    layer.topk, layer.candidates = dict(carry.get("topk", {})), carry.get("candidates")
    block = module.layers[cut]
    with _counting(expert_counts, b["valid"]) as counts:
        with jax.named_scope(f"layer_{cut}"):
            tiles = _tiles(b, req, "kept_first", "kept_qlen", "kv_floor", size)  # the cut layer wrote every row
            y, cache = layer.attend(block, carry["x"], meta, req, tiles, cache, band=gathered_band(*carry["band"]),
                                    kv=carry["kv"])
            s = ffn_and_output(block, c, carry["R"], HcMix(carry["pre"], carry["post"], carry["comb"]), y,
                               carry["ids"])
        tiles = _tiles(b, req, "kept_first", "kept_qlen", "dec_floor", size)
        for block in module.layers[cut + 1:]:
            with jax.named_scope(f"layer_{block.role.layer_id}"):
                R, mix, x = attention_input(block, c, s)
                with jax.named_scope("attn"):
                    y, cache = layer.attend(block, x, meta, req, tiles, cache)
                s = ffn_and_output(block, c, R, mix, y, carry["ids"])
    with jax.named_scope("logits"):
        R, pre = final_streams(s)
        h_TD = module.norm(hc_collapse(R, pre))
        logits = module.head(h_TD[req["logit_row"]], jnp.float32)
    with jax.named_scope("row_logprobs"):  # prompt logprobs: the head on every kept row, only when asked
        rows = jax.lax.cond(b["rows_wanted"], lambda: _row_logprobs(module, h_TD, b["rows_next"]),
                            lambda: _no_row_logprobs(h_TD.shape[0], c.vocab_size))
    return cache, logits, rows, _stacked(counts, module)


def _row_logprobs(module, h_TD: jax.Array, next_T: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    logp = jax.nn.log_softmax(module.head(h_TD, jnp.float32), axis=-1)
    top_lp, top_ids = jax.lax.top_k(logp, min(MAX_LOGPROBS, logp.shape[-1]))
    return jnp.take_along_axis(logp, next_T[:, None], axis=-1)[:, 0], top_ids.astype(jnp.int32), top_lp


def _no_row_logprobs(T: int, V: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    K = min(MAX_LOGPROBS, V)
    return jnp.zeros((T,), jnp.float32), jnp.zeros((T, K), jnp.int32), jnp.zeros((T, K), jnp.float32)

