"""The speculative end of a step, one compiled function after segment 2 (in place of the plain sampler):
verify each request's drafts against the target's logits, roll back the rejected rows, then draft the next
block from the emitted bonus token - so a decode step is snapshot -> segment 1 -> segment 2 -> this, and its
one device->host copy holds the emitted tokens and the next drafts.

Requests are rows of the step (R: their count padded to a bucket); each has n_draft drafts to verify (0 for a
prefill chunk, which samples its last row as usual and drafts its first block). The draft distributions q live on
the device between steps, per slot ([num_slots, B, V]), so they never cross to the host.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from serving.runtime import draft, rollback
from serving.runtime.kv_cache import CacheLayout, KVCache
from serving.runtime.rollback import CacheSites
from serving.runtime.sampler import SamplingArrays, target_logprobs, token_logprobs, top_logprobs
from serving.runtime.speculative import SpeculativeConfig, verify


class SpecInputs(NamedTuple):
    """Host arrays [R] of one step (R: the step's requests, padded to a power of two up to max_num_seqs)."""

    slot_R: jax.Array
    row0_pos_R: jax.Array  # position of the request's first verified row (its last emitted token)
    n_draft_R: jax.Array  # drafts verified this step
    drafts_RK: jax.Array  # [R, k] the drafts (tokens of rows 1 .. n_draft)
    first_row_R: jax.Array  # the request's first row in segment 1 (its verified rows follow it)
    floor_R: jax.Array  # replay_start: draft context rows below it are never read
    active_R: jax.Array  # the request samples this step
    block_table_RM: jax.Array
    ban_rows_R: jax.Array  # the first this many verified rows may not emit the step's banned ids (min_tokens)


class SpecOutput(NamedTuple):
    emitted_RJ: jax.Array  # accepted drafts, then the bonus token
    n_accepted_R: jax.Array
    logprob_RJ: jax.Array  # each emitted token's log-probability under the unfiltered target distribution
    top_ids_RJL: jax.Array
    top_logprobs_RJL: jax.Array
    drafts_RB: jax.Array  # the next block's drafts
    confidence_RB: jax.Array


def snapshot(layout: CacheLayout, J: int, cache: KVCache, s: SpecInputs) -> CacheSites:
    return rollback.snapshot(layout, cache, s.slot_R, s.row0_pos_R, s.block_table_RM, J)


def finish(module, layout: CacheLayout, spec: SpeculativeConfig, cache: KVCache, tail_rows: dict, snap: CacheSites,
           q_buf_SBV: jax.Array, logits_RJV: jax.Array, s: SpecInputs, p: SamplingArrays, *, max_top_k: int,
           fake_quant: bool = False) -> tuple[KVCache, jax.Array, SpecOutput]:
    """(cache, the draft distributions per slot, what the host reads). `tail_rows` {ratio-2 source: [T, 2, d]}:
    segment 1's raw rows (the carry); `p`: the sampling arrays of the step's rows."""
    R = s.slot_R.shape[0]  # the step's requests (a bucket of them), the first rows of the logits
    logits_RJV = logits_RJV[:R]
    _, J, V = logits_RJV.shape
    rep = lambda a: jnp.repeat(a, J, axis=0)  # noqa: E731  per row -> per verified row
    # a row emitting output min_tokens or earlier samples without the banned ids (EOS, stop ids), as plain decoding
    p_rows = jax.tree.map(rep, p)
    banning = jnp.tile(jnp.arange(J), R) < rep(s.ban_rows_R)
    p_rows = dataclasses.replace(p_rows, banned_RB=jnp.where(banning[:, None], p_rows.banned_RB, -1))
    logp, greedy = target_logprobs(logits_RJV.reshape(R * J, V), p_rows, max_top_k=max_top_k)
    greedy = greedy.reshape(R, J)[:, 0]
    K = J - 1
    method = spec.rejection_sample_method
    emitted, n = verify(logp.reshape(R, J, V), greedy, s.drafts_RK, q_buf_SBV[s.slot_R, :K], s.n_draft_R,
                        p.seed_R, s.row0_pos_R, method=method,
                        synthetic_rate=spec.synthetic_rate if method == "synthetic" else 0.0)
    logprob = token_logprobs(logits_RJV, emitted)
    top_lp, top_ids = top_logprobs(logits_RJV, p.logprobs_R)  # only when a row asks for them
    committed = {src: rows[s.first_row_R + n] for src, rows in tail_rows.items()}
    cache = rollback.restore(layout, cache, snap, s.slot_R, s.row0_pos_R, s.block_table_RM, s.n_draft_R, n,
                             committed)
    anchor = jnp.take_along_axis(emitted, n[:, None], axis=1)[:, 0]
    anchor_pos = s.row0_pos_R + n + 1
    hidden, base = draft.propose(module, layout, cache, anchor, anchor_pos, s.slot_R, s.floor_R,
                                 fake_quant=fake_quant)
    greedy_drafts = greedy | (spec.draft_sample_method == "greedy")
    drafts, q, conf = draft.markov_draft(module.dspark, hidden, base, anchor, anchor_pos, greedy_drafts,
                                         p.temperature_R, p.seed_R)
    q_buf = q_buf_SBV.at[jnp.where(s.active_R, s.slot_R, q_buf_SBV.shape[0])].set(q, mode="drop")
    return cache, q_buf, SpecOutput(emitted, n, logprob, top_ids, top_lp, drafts, conf)
