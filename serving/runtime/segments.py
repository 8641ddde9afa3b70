"""The two CED prefill segments, separate jitted functions over the flattened parameter leaves.

segment 1  every row of the step: embedding, layers 0 .. cut-1, then the cut layer up to its KV path
           (mHC + attn_norm, SWA rows, global rows + index keys written to the cache).
segment 2  the kept rows (all of them with replay off; each prefill's last `window` rows with decoder
           replay on; decode rows always): the rest of the cut layer - queries, indexer and candidates,
           attention, its SWA ring write - and layers cut+1 .. L-1, then the logits of each request's
           last row, and (under a cond, when a chunk asks) every kept row's next-token logprobs. Its
           shapes are its own row buckets, so trimming costs no recompilation.
Decode steps run through the same two functions with every row kept. A V4 model (no CED cut) splits at its last
layer (`split_layer`) and keeps every row.

With speculative decoding (a layout with draft stages) segment 2 also writes each DSpark stage's context rows of
its kept rows (serving.runtime.draft) and returns the logits of each request's last J rows - a verification
chunk's 1 + k - and segment 1 leaves the ratio-2 sources' raw rows in the carry for the rollback.

With `expert_counts` each segment also returns the per-expert token counts of the MoE layers it ran
([cut, E] and [L - cut, E] int32, valid rows only: segment 2's are the kept rows, the rows those layers
compute), for the expert load balancer; otherwise None.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dsv41.block import Streams, attention_input, ffn_and_output, final_streams, mean_stream
from dsv41.layers import expert_load
from dsv41.layers.engram import EngramLayout
from dsv41.layers.mhc import hc_collapse
from dsv41.layers.rope import inv_freq, rope_angles
from pallas_kernels.sparse_attention import AttnMeta
from pallas_kernels.tiles import QueryTiles
from serving.runtime import draft, global_kv, kv_cache
from serving.runtime.attention import paged_attention, write_ring
from serving.runtime.decoder_replay import gather_kept
from serving.runtime.kv_cache import CacheLayout, KVCache
from serving.runtime.sampling_params import MAX_LOGPROBS
from serving.runtime.step import INDEX_RATIOS, Rows, SegmentCarry, StepBatch


class _RowView(NamedTuple):
    """The rows one run of layers computes (segment 1's, or segment 2's kept ones) and their SWA floor."""

    pos_T: jax.Array
    req_T: jax.Array
    valid_T: jax.Array
    tiles: QueryTiles
    floor_R: jax.Array  # lowest visible SWA position per request


class _CutKV(NamedTuple):
    """The cut layer's SWA rows as segment 2 resumes it: the kept rows' own, and every row of the step
    (a kept row's window reaches into trimmed rows) with each kept row's index among them."""

    kept_Td: jax.Array
    step_Nd: jax.Array
    row_T: jax.Array


class _Layers:
    """Runs blocks' attention sublayers against the cache over one row view, threading the top-k row ids
    and candidate blocks that index sources publish to later layers."""

    def __init__(self, layout: CacheLayout, batch: StepBatch, fake_quant: bool, topk: dict | None = None):
        self.layout, self.requests, self.fake_quant = layout, batch.requests, fake_quant
        self.index_blocks_2 = batch.index_blocks_2
        self.topk: dict[int, jax.Array] = dict(topk or {})
        self.candidates: jax.Array | None = None
        self.raw_tails: dict[int, jax.Array] = {}  # speculative decoding: ratio-2 sources' raw rows

    def attend(self, block, x_TD: jax.Array, at: _RowView, cache: KVCache, cut_kv: _CutKV | None = None
               ) -> tuple[jax.Array, KVCache]:
        """The attention sublayer of `block` over the rows `at` ([T, D] -> [T, D]) and the cache it leaves.

        The model's mechanism (`dsv41.model.backbone_attention`) with its projections and KV-source math
        (`dsv41.layers.attention.publish_kv_source`), on a paged cache instead of one sequence's arrays: the queries
        stay un-rotated (the fused `paged_attention` applies RoPE and its inverse), a KV source writes its rows
        into cache blocks (`global_kv.publish_source`), an index source selects with the paged indexer op
        (`global_kv.select_rows`), the keys are the request's SWA ring plus this step's rows and the paged rows
        its top-k names, and the step's SWA rows go into the ring afterwards (`write_ring`). At the cut layer in
        segment 2, `cut_kv` carries the SWA rows segment 1 computed."""
        layout, c, role, attn, req = self.layout, self.layout.config, block.role, block.attn, self.requests
        cos, sin = rope_angles(at.pos_T, inv_freq(c, role.rope))
        qr, q = attn.queries(x_TD)
        if cut_kv is None:
            kv = attn.project_kv(x_TD, cos, sin, self.fake_quant)
            kv_all, kv_row = kv, None
            if role.is_kv_source:
                with jax.named_scope("kv_write"):
                    cache, raw = global_kv.publish_source(layout, block, x_TD, at.pos_T, at.req_T, at.valid_T, req,
                                                          cache, self.fake_quant)
                if raw is not None and layout.draft_stages:
                    self.raw_tails[role.layer_id] = raw
        else:
            kv, kv_all, kv_row = cut_kv
        rows_cache = topk = None
        if role.attn_kind == "hca":  # V4: every visible row of its own compressed KV
            n_rows = req.block_table_RM.shape[1] * layout.rows_per_block(role.kv_source)
            topk = global_kv.all_rows(at.pos_T, role.compress_ratio, n_rows)
            rows_cache = cache.rows[role.kv_source]
        elif role.attn_kind != "swa":  # V4.1's compressed layers, V4's CSA
            if role.is_index_source:
                queries = lambda: attn.indexer.queries(x_TD, qr, cos, sin, self.fake_quant)  # noqa: E731
                with jax.named_scope("indexer"):
                    ids, cand = global_kv.select_rows(layout, block, queries, at.pos_T, at.req_T, at.tiles, req,
                                                      self.index_blocks_2, cache.keys[role.kv_source],
                                                      self.candidates)
                self.topk[role.layer_id] = ids
                if role.is_candidate_source:
                    self.candidates = cand
            topk, rows_cache = self.topk[role.index_source], cache.rows[role.kv_source]
        n_blocks = None  # the global-row blocks of the step's longest context (the XLA path's scan length)
        if rows_cache is not None:
            n_blocks = self.index_blocks_2[INDEX_RATIOS.index(c.compress_ratios[role.kv_source])]
        meta = AttnMeta(at.pos_T, at.req_T, req.slot_R, req.start_R, at.floor_R, req.block_table_RM, kv_row, at.tiles,
                        n_blocks)
        with jax.named_scope("sparse_mla"):
            o = paged_attention(q, cos, sin, attn.attn_sink[...], kv_all, cache.swa[role.layer_id], meta,
                                rows_cache=rows_cache, topk_Tk=topk, impl=block.kernel_impl, out_dtype=x_TD.dtype)
        last_rows = at.valid_T & (at.pos_T >= req.end_R[at.req_T] - layout.window)
        o, ring = kv_cache.after_reads(o, cache.swa[role.layer_id])
        cache = cache.updated(swa={role.layer_id: write_ring(layout.swa_format, ring, kv, at.pos_T,
                                                             req.slot_R[at.req_T], last_rows)})
        return attn.project_out(o, x_TD.dtype), cache


def _counts(on: bool, choices: list[jax.Array], valid_T: jax.Array, module) -> jax.Array | None:
    """[layers, E] int32 expert counts of the MoE layers run (None when not collecting)."""
    if not on:
        return None
    E = module.layers[0].ffn.n_experts
    if not choices:
        return jnp.zeros((0, E), jnp.int32)
    return jnp.stack([expert_load.expert_counts(sel, valid_T, E) for sel in choices])


def _pending_hash_ids(c, rows: Rows, terms_VL2: jax.Array) -> jax.Array:
    """rows.engram_TEc with each pending row's hash ids (a request's last row, its token just substituted) finished
    from the token's term and the host's look-back."""
    T = rows.ids_T.shape[0]
    last_R = jnp.clip(rows.first_R + rows.qlen_R - 1, 0, T - 1)
    pending_R = (rows.qlen_R > 0) & (rows.prev_T[last_R] >= 0)
    ids_RLC = EngramLayout.from_config(c).device_hash_ids(terms_VL2[rows.ids_T[last_R]], rows.engram_look_back_RLS2)
    return rows.engram_TEc.at[jnp.where(pending_R, last_R, T)].set(ids_RLC, mode="drop")


def split_layer(c) -> int:
    """The layer the two segments share: V4.1's CED cut; V4 (no cut, every row runs every layer, nothing is
    trimmed) its last layer, so both families run the same two functions."""
    return c.cut_layer if c.family == "v41" else c.num_hidden_layers - 1


def segment1(module, layout: CacheLayout, cache: KVCache, batch: StepBatch, *, fake_quant: bool,
             expert_counts: bool = False, prev_tokens: jax.Array | None = None,
             engram_terms: jax.Array | None = None) -> tuple[KVCache, SegmentCarry, jax.Array | None]:
    """(cache, the carry of the bucket's rows (`write_carry` puts it in the persistent buffer), expert counts of layers
    0 .. cut-1 [cut, E] or None).
    `prev_tokens`: the previous step's sampled tokens, read by the rows whose `rows.prev_T` names one of them (async
    scheduling: the host has not seen those tokens yet). `engram_terms` [V, L, 2]: every token's Engram hash term,
    from which those rows' hash ids are finished (`EngramLayout.token_terms`)."""
    c, cut = layout.config, split_layer(layout.config)
    rows, req = batch.rows, batch.requests
    if prev_tokens is not None:
        ids = jnp.where(rows.prev_T >= 0, prev_tokens[jnp.maximum(rows.prev_T, 0)].astype(rows.ids_T.dtype),
                        rows.ids_T)
        rows = dataclasses.replace(rows, ids_T=ids)
        if engram_terms is not None:
            rows = dataclasses.replace(rows, engram_TEc=_pending_hash_ids(c, rows, engram_terms))
    at = _RowView(rows.pos_T, rows.req_T, rows.valid_T, rows.tiles, req.kv_floor_R)
    layers = _Layers(layout, batch, fake_quant)
    e = module.embed(rows.ids_T)
    s = Streams(jnp.broadcast_to(e[:, None, :], (e.shape[0], c.hc_mult, e.shape[1])), None, None)
    choices = []
    for block in module.layers[:cut]:
        with jax.named_scope(f"layer_{block.role.layer_id}"):
            R, mix, x = attention_input(block, c, s, rows.engram_TEc)
            with jax.named_scope("attn"):
                y, cache = layers.attend(block, x, at, cache)
            s, sel = ffn_and_output(block, c, R, mix, y, rows.ids_T, rows.valid_T)
            choices.append(sel)
    block = module.layers[cut]
    with jax.named_scope(f"layer_{cut}_kv_path"):
        R, mix, x = attention_input(block, c, s, rows.engram_TEc)
        cos, sin = rope_angles(rows.pos_T, inv_freq(c, block.role.rope))
        kv = block.attn.project_kv(x, cos, sin, fake_quant)
        if block.role.is_kv_source:
            cache, _ = global_kv.publish_source(layout, block, x, rows.pos_T, rows.req_T, rows.valid_T, req, cache,
                                                fake_quant)  # V4.1's cut source has ratio 1: no tail
    read_later = {r.index_source for r in c.roles[cut:] if r.index_source is not None}  # top-k segment 2 reads
    topk = {l: ids for l, ids in layers.topk.items() if l in read_later}
    carry = SegmentCarry(R, x, mix, kv, rows.ids_T, rows.pos_T, rows.req_T, topk, layers.raw_tails)
    return cache, carry, _counts(expert_counts, choices, rows.valid_T, module)


def write_carry(carry_buf: SegmentCarry, carry: SegmentCarry) -> SegmentCarry:
    # Rows [0, T) of the persistent max-size buffer: segment 2's input shapes then depend on its own bucket only.
    return jax.tree.map(lambda buf, a: jax.lax.dynamic_update_slice_in_dim(buf, a.astype(buf.dtype), 0, 0),
                        carry_buf, carry)


def segment2(module, layout: CacheLayout, cache: KVCache, carry_buf: SegmentCarry, batch: StepBatch, *,
             fake_quant: bool, expert_counts: bool = False, verify_buf: jax.Array | None = None
             ) -> tuple[KVCache, jax.Array | tuple[jax.Array, jax.Array], tuple, jax.Array | None]:
    """(cache, logits of each request's last row [max_num_seqs, V], zeros past `Buckets.requests` of the kept rows
    (speculative decoding: each draft stage's context rows are written, and the logits are a pair - row 0 of each
    request's J verified rows [max_num_seqs, V], which is its last row when it verifies no drafts, and
    `verify_buf` [max_num_seqs, J - 1, V] with rows 1 .. J - 1 written only when a request verifies drafts: a
    donated buffer, so a step verifying none writes no more logits than a plain one), prompt logprobs of every kept
    row:
    next-token logprob [K] and top ids / logprobs [K, MAX_LOGPROBS] - zeros unless a chunk asked for them - and
    the expert counts of layers cut .. L-1 over the kept rows [L - cut, E] or None)."""
    c, cut = layout.config, split_layer(layout.config)
    kept, req = batch.kept, batch.requests
    carry = gather_kept(carry_buf, kept)
    layers = _Layers(layout, batch, fake_quant, topk=carry.topk)
    block = module.layers[cut]
    choices = []
    with jax.named_scope(f"layer_{cut}"):  # the cut layer wrote every row's SWA KV: only replay_start floors it
        at = _RowView(carry.pos_T, carry.req_T, kept.valid_K, kept.tiles, req.kv_floor_R)
        with jax.named_scope("attn"):
            y, cache = layers.attend(block, carry.x_TD, at, cache,
                                     cut_kv=_CutKV(carry.kv_Td, carry_buf.kv_Td, kept.row_K))
        s, sel = ffn_and_output(block, c, carry.R_TnD, carry.mix, y, carry.ids_T, kept.valid_K)
        choices.append(sel)
    at = at._replace(floor_R=req.decoder_floor_R)
    targets = c.dspark_target_layer_ids if layout.draft_stages else ()
    features = {cut: jnp.mean(carry.R_TnD.astype(jnp.float32), axis=1)} if cut in targets else {}
    for block in module.layers[cut + 1:]:
        with jax.named_scope(f"layer_{block.role.layer_id}"):
            if block.role.layer_id in targets:
                features[block.role.layer_id] = mean_stream(s)
            R, mix, x = attention_input(block, c, s)
            with jax.named_scope("attn"):
                y, cache = layers.attend(block, x, at, cache)
            s, sel = ffn_and_output(block, c, R, mix, y, carry.ids_T, kept.valid_K)
            choices.append(sel)
    if targets:
        with jax.named_scope("draft_context"):  # each request's last `window` rows: what a later draft reads
            write = kept.valid_K & (carry.pos_T >= req.end_R[carry.req_T] - layout.window)
            cache = draft.write_context(module.dspark, layout, cache, jnp.stack([features[t] for t in targets], 1),
                                        carry.pos_T, req.slot_R[carry.req_T], write, fake_quant)
    with jax.named_scope("logits"):
        R, pre = final_streams(s)
        h_TD = module.norm(module.hc_head(R) if module.hc_head is not None else hc_collapse(R, pre))
        # The head runs on the step's requests only (`Buckets.requests`: the first min(max_num_seqs, kept rows) of
        # logit_row_R; a decode of one request: 2 rows, not max_num_seqs), zeros below.
        rows_R = kept.logit_row_R
        n = min(rows_R.shape[0], h_TD.shape[0])
        head = lambda rows: module.head(h_TD[rows.reshape(-1)], jnp.float32).reshape(*rows.shape, -1)  # noqa: E731
        pad = lambda a: jnp.pad(a, ((0, rows_R.shape[0] - n),) + ((0, 0),) * (a.ndim - 1))  # noqa: E731
        if rows_R.ndim == 1:
            logits = pad(head(rows_R[:n]))
        else:  # rows 1 .. J - 1 only when a request verifies drafts (the engine's plain steps verify none)
            rest = jax.lax.cond(jnp.any(rows_R[:n, -1] != rows_R[:n, 0]),
                                lambda: jax.lax.dynamic_update_slice_in_dim(verify_buf, head(rows_R[:n, 1:]), 0, 0),
                                lambda: verify_buf)
            logits = (pad(head(rows_R[:n, 0])), rest)
    with jax.named_scope("prompt_logprobs"):  # the head on every kept row, only when a chunk asks
        rows = jax.lax.cond(jnp.any(kept.prompt_next_K >= 0),
                            lambda: _prompt_logprobs(module, h_TD, jnp.maximum(kept.prompt_next_K, 0)),
                            lambda: _no_prompt_logprobs(h_TD.shape[0], c.vocab_size))
    return cache, logits, rows, _counts(expert_counts, choices, kept.valid_K, module)


# Rows per head call of the prompt logprobs. A compiled step reserves its cond branches' temporaries whether or not
# a step takes them, and a call's [rows, V] float32 logits and log-probabilities are V4's vocabulary x 8 bytes a row:
# 265 MB at 256 rows, 8.5 GB for the 8,192 kept rows of a full-size prefill step in one call.
PROMPT_LOGPROB_ROWS = 256


def _prompt_logprobs(module, h_TD: jax.Array, next_T: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each row's log-probability of next_T [T], and its MAX_LOGPROBS most likely ids and log-probabilities
    [T, MAX_LOGPROBS], PROMPT_LOGPROB_ROWS rows at a time (the last group padded with zero rows)."""
    T, D = h_TD.shape
    n = min(T, PROMPT_LOGPROB_ROWS)
    pad = -T % n

    def rows(h_nD: jax.Array, next_n: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        logp = jax.nn.log_softmax(module.head(h_nD, jnp.float32), axis=-1)
        top_lp, top_ids = jax.lax.top_k(logp, min(MAX_LOGPROBS, logp.shape[-1]))
        return jnp.take_along_axis(logp, next_n[:, None], axis=-1)[:, 0], top_ids.astype(jnp.int32), top_lp

    groups = (jnp.pad(h_TD, ((0, pad), (0, 0))).reshape(-1, n, D), jnp.pad(next_T, (0, pad)).reshape(-1, n))
    out = jax.lax.map(lambda g: rows(*g), groups)
    return tuple(a.reshape(-1, *a.shape[2:])[:T] for a in out)


def _no_prompt_logprobs(T: int, V: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    K = min(MAX_LOGPROBS, V)
    return jnp.zeros((T,), jnp.float32), jnp.zeros((T, K), jnp.int32), jnp.zeros((T, K), jnp.float32)
