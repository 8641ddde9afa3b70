"""On-device sampling with per-request parameters as arrays (changing them never recompiles).

Greedy rows take the argmax of the full logits. Other rows sample by Gumbel-max: over the whole
vocabulary when the row has no top-k / top-p / min-p filter, else over a candidate set of the
`max_top_k` largest logits on which top-k, top-p (nucleus, on the temperature-scaled distribution) and
min-p are applied. The candidate indices from `lax.top_k` are consumed whole (never sliced) so XLA keeps
its TopK call instead of sorting the vocabulary (jax-notes §6.3). Each request's noise comes from its
seed folded with the position, so a seeded request reproduces whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from serving.runtime.sampling_params import MAX_BANNED, MAX_LOGPROBS, SamplingParams


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingArrays:
    """Each row's sampling parameters [R] (the step's requests, then greedy padding rows)."""

    temperature_R: jax.Array  # float32, 0 = greedy
    top_k_R: jax.Array  # int32, 0 = off
    top_p_R: jax.Array  # float32
    min_p_R: jax.Array  # float32
    seed_R: jax.Array  # uint32: the row's noise is its seed folded with its position
    position_R: jax.Array  # int32: the position sampled
    banned_RB: jax.Array  # int32 [R, MAX_BANNED]: ids the row may not sample (-1: none)
    logprobs_R: jax.Array  # int32: top logprobs the row asks for (0: none)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Sampled:
    """What the sampler returns per row [R] (zeros past the step's requests)."""

    tokens_R: jax.Array  # int32
    logprob_R: jax.Array  # float32: the token's log-probability under the unfiltered model distribution
    top_ids_RL: jax.Array  # int32 [R, MAX_LOGPROBS]
    top_logprobs_RL: jax.Array  # float32 [R, MAX_LOGPROBS]


def sampling_arrays(params: list[SamplingParams | None], positions: list[int], rows: int, default_seed: int,
                    banned: list[list[int]] | None = None) -> SamplingArrays:
    """Per-request parameter arrays padded to `rows` (missing rows are greedy). `banned[i]`: token ids row i may
    not sample (EOS and stop ids while `min_tokens` are not out yet), at most MAX_BANNED."""
    out = SamplingArrays(np.zeros(rows, np.float32), np.zeros(rows, np.int32), np.ones(rows, np.float32),
                         np.zeros(rows, np.float32), np.zeros(rows, np.uint32), np.zeros(rows, np.int32),
                         np.full((rows, MAX_BANNED), -1, np.int32), np.zeros(rows, np.int32))
    for i, ids in enumerate(banned or []):
        if len(ids) > MAX_BANNED:
            raise ValueError(f"row {i}: {len(ids)} banned tokens exceed {MAX_BANNED}")
        out.banned_RB[i, : len(ids)] = ids
    for i, (p, pos) in enumerate(zip(params, positions)):
        p = p or SamplingParams(temperature=0.0)
        out.temperature_R[i], out.top_k_R[i] = p.temperature, p.top_k
        out.top_p_R[i], out.min_p_R[i] = p.top_p, p.min_p
        out.seed_R[i] = (default_seed + i if p.seed is None else p.seed) & 0xFFFFFFFF
        out.position_R[i] = pos
        out.logprobs_R[i] = p.logprobs or 0
    return out


def sample(logits_RV: jax.Array, p: SamplingArrays, *, max_top_k: int) -> Sampled:
    """Sampled token ids [R], their log-probabilities under the unfiltered model distribution [R], and the
    MAX_LOGPROBS most likely tokens' ids and log-probabilities [R, MAX_LOGPROBS] (OpenAI `top_logprobs`; zeros in a
    step where no row asks for top logprobs, `p.logprobs_R`). Banned ids are never sampled; logprobs stay those of
    the model (vLLM's raw logprobs). What no row of the step needs is skipped by `lax.cond` (the candidate top-k when
    no row filters, the top logprobs, the ban mask): before, two vocabulary-wide top-k's were a sizeable share of a
    greedy decode step of the peer V4 (docs/design/measurements.md)."""
    raw = logits_RV.astype(jnp.float32)
    R, V = raw.shape
    K = min(max_top_k, V)
    greedy = p.temperature_R <= 0
    temp = jnp.where(greedy, 1.0, p.temperature_R)[:, None]
    keys = jax.vmap(lambda s, pos: jax.random.fold_in(jax.random.key(s), pos))(p.seed_R, p.position_R)
    filtered = (p.top_k_R > 0) | (p.top_p_R < 1) | (p.min_p_R > 0)

    def gumbel(shape_tail):
        return jax.vmap(lambda k: jax.random.gumbel(k, shape_tail, jnp.float32))(keys)

    def draw(logits):
        def filtered_draw():
            cand_ids, scaled, keep = _candidates(logits, p, temp, K)
            cand_choice = argmax(jnp.where(keep, scaled + gumbel((K,)), -jnp.inf))
            return jnp.take_along_axis(cand_ids, cand_choice[:, None], axis=-1)[:, 0]

        zeros = lambda: jnp.zeros((R,), jnp.int32)  # noqa: E731
        filtered_tok = jax.lax.cond(jnp.any(~greedy & filtered), filtered_draw, zeros)
        full_tok = jax.lax.cond(jnp.any(~greedy & ~filtered), lambda: argmax(logits / temp + gumbel((V,))), zeros)
        return jnp.where(greedy, argmax(logits), jnp.where(filtered, filtered_tok, full_tok))

    tok = _with_bans(draw, raw, p.banned_RB)
    top_lp, top_ids = top_logprobs(raw, p.logprobs_R)
    return Sampled(tok.astype(jnp.int32), token_logprobs(raw, tok), top_ids, top_lp)


def sample_rows(logits_RV: jax.Array, p: SamplingArrays, *, rows: int, ranks: int = 1, max_top_k: int) -> Sampled:
    """`sample` on each rank's first `rows` of its R / ranks logit rows (a step's requests come first; the others
    are padding), the outputs zero-padded back to R rows: a decode of one request samples 2 rows, not
    max_num_seqs (a sample of V4's vocabulary costs more with every row: docs/design/measurements.md).
    Each row draws from its own (seed, position) key, so its token is the one the full call gives."""
    R = logits_RV.shape[0]
    S = R // ranks
    if rows >= S:
        return sample(logits_RV, p, max_top_k=max_top_k)

    def first(a):
        return a.reshape(ranks, S, *a.shape[1:])[:, :rows].reshape(ranks * rows, *a.shape[1:])

    def back(a):
        a = a.reshape(ranks, rows, *a.shape[1:])
        return jnp.pad(a, ((0, 0), (0, S - rows)) + ((0, 0),) * (a.ndim - 2)).reshape(R, *a.shape[2:])

    out = sample(first(logits_RV), jax.tree.map(first, p), max_top_k=max_top_k)
    return jax.tree.map(back, out)


def token_logprobs(raw_xV: jax.Array, tok_x: jax.Array) -> jax.Array:
    """log_softmax(raw)[tok] [...] float32 by jax.nn.log_softmax's own ops on the picked entries ((x - max) -
    log(sum(exp(x - max))): the same bits) without the [..., V] log-probabilities. The barrier keeps XLA from
    merging this max with the sampler's argmax max: XLA:CPU then wrote the whole [R, V] subtraction and argmax
    mask out, several times the step's cost without both (docs/design/measurements.md)."""
    x = jax.lax.optimization_barrier(raw_xV.astype(jnp.float32))
    m = jnp.max(x, axis=-1, initial=-jnp.inf)
    lse = jnp.log(jnp.sum(jnp.exp(x - m[..., None]), axis=-1))
    return (jnp.take_along_axis(x, tok_x[..., None].astype(jnp.int32), axis=-1)[..., 0] - m) - lse


def top_logprobs(raw_xV: jax.Array, asked_R: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The MAX_LOGPROBS largest log-probabilities of the logits `raw_xV` [..., L] and their ids (int32) over the
    last axis, when any row asks for top logprobs (`asked_R`: `SamplingArrays.logprobs_R`); zeros
    otherwise (nothing reads them). The log-softmax runs inside the branch, so a step that asks for none never
    writes [..., V] log-probabilities."""
    L = min(MAX_LOGPROBS, raw_xV.shape[-1])
    shape = (*raw_xV.shape[:-1], L)

    def top():
        values, ids = jax.lax.top_k(jax.nn.log_softmax(raw_xV.astype(jnp.float32), axis=-1), L)
        return values, ids.astype(jnp.int32)

    none = lambda: (jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.int32))  # noqa: E731
    return jax.lax.cond(jnp.any(asked_R > 0), top, none)


def argmax(x_NV: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis (the first index of the largest value; of the first NaN, if any) [N] int32, as a
    max and a min-reduce of indices: XLA:CPU's variadic arg-reduce is several times slower
    (docs/design/measurements.md)."""
    m = jnp.max(x_NV, axis=-1, keepdims=True)
    at = (x_NV == m) | (jnp.isnan(x_NV) & jnp.isnan(m))
    return jnp.min(jnp.where(at, jnp.arange(x_NV.shape[-1], dtype=jnp.int32), x_NV.shape[-1]), axis=-1)


def _with_bans(fn, raw_NV: jax.Array, ban_NB: jax.Array):
    """`fn` of the logits with each row's banned ids (-1: none) at -inf; the [N, V] mask only in a step that bans
    any. The cond returns what `fn` returns, never the logits themselves: a branch returning its [N, V] operand
    unchanged made XLA copy it on every step, a large share of a greedy sample on a CPU. `fn` is traced in both
    branches, so a sampler compiles a little longer (docs/design/measurements.md)."""
    N, V = raw_NV.shape

    def banned():
        hits = jnp.zeros((N, V), jnp.int32).at[jnp.arange(N)[:, None], jnp.maximum(ban_NB, 0)].add(
            (ban_NB >= 0).astype(jnp.int32))
        return fn(jnp.where(hits > 0, -jnp.inf, raw_NV))

    return jax.lax.cond(jnp.any(ban_NB >= 0), banned, lambda: fn(raw_NV))


def _candidates(logits_NV: jax.Array, p: SamplingArrays, temp_N1: jax.Array, K: int
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The K largest logits, sorted descending: their ids [N, K], temperature-scaled values [N, K] and which of them
    top-k / top-p / min-p keep [N, K]."""
    cand_vals, cand_ids = jax.lax.top_k(logits_NV, K)
    scaled = cand_vals / temp_N1
    probs = jax.nn.softmax(scaled, axis=-1)
    rank = jnp.arange(K)[None]
    keep = jnp.where(p.top_k_R[:, None] > 0, rank < p.top_k_R[:, None], True)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before this candidate
    keep &= before < p.top_p_R[:, None]
    keep &= probs >= p.min_p_R[:, None] * probs[:, :1]
    return cand_ids, scaled, keep


def target_logprobs(logits_NV: jax.Array, p: SamplingArrays, *, max_top_k: int) -> tuple[jax.Array, jax.Array]:
    """The distribution `sample` draws each row from, as log-probabilities [N, V] (-inf where it never samples:
    banned ids, and outside top-k / top-p / min-p), and which rows are greedy [N] (their argmax is the draw).
    Speculative verification reads it (serving.runtime.speculative)."""
    raw = logits_NV.astype(jnp.float32)
    N, V = raw.shape
    greedy = p.temperature_R <= 0
    temp = jnp.where(greedy, 1.0, p.temperature_R)[:, None]
    filtered = ((p.top_k_R > 0) | (p.top_p_R < 1) | (p.min_p_R > 0)) & ~greedy

    def scaled(logits):
        def with_filters():
            cand_ids, _, keep = _candidates(logits, p, temp, min(max_top_k, V))
            kept_V = jnp.zeros((N, V), jnp.bool_).at[jnp.arange(N)[:, None], cand_ids].set(keep)
            return jnp.where(filtered[:, None] & ~kept_V, -jnp.inf, logits / temp)

        # the candidate top-k only when a row filters (a greedy batch needs the argmax alone)
        return jax.lax.cond(jnp.any(filtered), with_filters, lambda: logits / temp)

    return jax.nn.log_softmax(_with_bans(scaled, raw, p.banned_RB), axis=-1), greedy
