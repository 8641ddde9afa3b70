"""Training forwards of a V4.1 model: the backbone's losses on one sequence, and the DSpark drafter's losses
against the frozen backbone. Both run the model's own NNX modules (blocks, mHC, attention projections,
compressor, indexer, router, experts, Engram) and the backbone its attention callback
(`dsv41.model.backbone_attention`: CED sharing, KV-source publishing, the indexer's selection); what differs
from `dsv41.model.forward` is only what a trainer needs on top and what makes long sequences cheap:

* attention over the window is banded (each block of `sliding_window` queries against its own and the
  previous block's keys) and the selected global rows are gathered (top-k ids), instead of [T, T] and
  [T, N] masks - the same softmax over the same keys (a test holds the logits equal to `forward`);
* each index source adds the lightning indexer's distillation loss (DeepSeek's DSA): the indexer's top-k
  and candidate-block selection are integer choices with no gradient, so the indexer (wq_b, weights_proj,
  and the KV source's wk / k_norm) learns from KL(p_attn || softmax(S)), where p_attn is the layer's own
  attention over every visible global row, summed over heads. Its inputs are stop-gradient so this loss
  trains only the indexer, and the LM loss never reaches the indexer;
* each MoE layer reports its expert loads (for the aux-loss-free bias update: the router bias only
  selects, so no gradient reaches it) and DeepSeek's sequence-wise balance loss sum_i f_i P_i.

V4.1 only (delayed pre-mix mHC, no hash routing; fake quant off: training is float32).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from dsv41.block import Block, Streams, final_streams, mean_stream
from dsv41.config import ModelConfig
from dsv41.layers.attention import sink_softmax
from dsv41.layers.basic import dense
from dsv41.layers.mhc import HcMix, hc_collapse, hc_post
from dsv41.layers.moe import MoE, swiglu
from dsv41.model import Published
from dsv41.model import backbone_attention as model_backbone_attention
from pallas_kernels.mhc import mhc_post_pre

_NEG = -1e30  # masked logits in differentiable paths: finite, so no inf - inf in a gradient
sg = jax.lax.stop_gradient


class MoeStats(NamedTuple):
    loads: jax.Array  # [E] tokens routed to each expert (int32)
    balance: jax.Array  # scalar: the sequence-wise balance loss sum_i f_i P_i


# ====================================================================== attention pieces
def window_attention(q_THd: jax.Array, kv_Td: jax.Array, sink_H: jax.Array, window: int,
                     rows_Nd: jax.Array | None = None, idx_Tk: jax.Array | None = None) -> jax.Array:
    """`masked_attention` of a sequence from position 0, banded: float32 [T, H, d].

    Query p sees SWA keys max(p - window + 1, 0) .. p and the global rows idx[p] (-1 = none), plus the sink.
    Queries go in blocks of b = window / 4 (when it divides), each against the window + b keys ending with
    its own block: 1.25 x the keys a query needs, where [T, T] masks cost T / window x.
    """
    T, H, d = q_THd.shape
    W = window
    b = W // 4 if W % 4 == 0 else W
    nb = W // b  # key blocks before a query's own
    nc = -(-T // b)
    pad = nc * b - T
    q = jnp.pad(q_THd.astype(jnp.float32), ((0, pad), (0, 0), (0, 0))).reshape(nc, b, H, d)
    kv = jnp.pad(kv_Td.astype(jnp.float32), ((0, pad), (0, 0))).reshape(nc, b, d)
    kv = jnp.concatenate([jnp.zeros((nb, b, d), jnp.float32), kv])
    keys = jnp.concatenate([kv[j: j + nc] for j in range(nb + 1)], axis=1)  # [nc, W + b, d]: blocks c-nb .. c
    q_pos = jnp.arange(nc * b).reshape(nc, b)
    k_pos = jnp.arange(nc)[:, None] * b - W + jnp.arange(W + b)[None, :]
    delta = q_pos[:, :, None] - k_pos[:, None, :]
    band = (delta >= 0) & (delta < W) & (k_pos[:, None, :] >= 0)  # [nc, b, W + b]
    scale = d ** -0.5
    logits = [jnp.where(band[:, :, None, :], jnp.einsum("cihd,cjd->cihj", q, keys) * scale, -jnp.inf)
              .reshape(nc * b, H, W + b)]
    if rows_Nd is not None:
        idx = jnp.pad(idx_Tk, ((0, pad), (0, 0)), constant_values=-1)
        gathered = jnp.take(rows_Nd.astype(jnp.float32), jnp.maximum(idx, 0), axis=0, mode="clip")  # [Tp, k, d]
        rl = jnp.einsum("thd,tkd->thk", q.reshape(nc * b, H, d), gathered) * scale
        logits.append(jnp.where((idx >= 0)[:, None, :], rl, -jnp.inf))
    probs, denom = sink_softmax(logits, sink_H)
    out = jnp.einsum("cihj,cjd->cihd", probs[0].reshape(nc, b, H, W + b), keys).reshape(nc * b, H, d)
    if rows_Nd is not None:
        out = out + jnp.einsum("thk,tkd->thd", probs[1], gathered)
    return (out / denom)[:T]


def indexer_kl(scores_TN: jax.Array, q_THd: jax.Array, rows_Nd: jax.Array, visible_TN: jax.Array, stride: int = 1
               ) -> jax.Array:
    """Mean over queries with a visible row of KL(p_attn || softmax(scores)) over the visible rows, on every
    `stride`-th query (the dense target costs [T, H, N]; a sample of queries trains the indexer as well).

    p_attn: the layer's attention (no sink, no window) over every visible global row, summed over heads
    and normalised; a constant target (stop-gradient)."""
    d = q_THd.shape[-1]
    scores_TN, q_THd, visible_TN = scores_TN[::stride], q_THd[::stride], visible_TN[::stride]
    attn = jnp.einsum("thd,nd->thn", sg(q_THd).astype(jnp.float32), sg(rows_Nd).astype(jnp.float32)) * d ** -0.5
    p = jax.nn.softmax(jnp.where(visible_TN[:, None, :], attn, _NEG), axis=-1).sum(axis=1)
    p = p / jnp.sum(p, axis=-1, keepdims=True)
    log_q = jax.nn.log_softmax(jnp.where(visible_TN, scores_TN, _NEG), axis=-1)
    kl = jnp.sum(jnp.where(visible_TN, p * (jnp.log(jnp.maximum(p, 1e-30)) - log_q), 0.0), axis=-1)
    has_rows = jnp.any(visible_TN, axis=-1)
    return jnp.sum(jnp.where(has_rows, kl, 0.0)) / jnp.maximum(jnp.sum(has_rows), 1)


def backbone_attention(c: ModelConfig, positions_T: jax.Array, pub: Published, indexer_losses: list[jax.Array],
                       kl_stride: int = 1) -> Callable:
    """The attention callback (block, normed x [T, D]) -> [T, D] of the backbone layers: the model's
    (`dsv41.model.backbone_attention`) over banded keys (`window_attention`), appending each index source's
    indexer loss to `indexer_losses`."""
    def over_keys(role, q, kv, sink, rows, ids):
        return window_attention(q, kv, sink, c.sliding_window, rows, ids)

    def on_scores(scores, q, rows, visible):
        indexer_losses.append(indexer_kl(scores, q, rows, visible, kl_stride))

    return model_backbone_attention(c, positions_T, pub, over_keys, on_scores=on_scores)


# ============================================================================= blocks and MoE
def dense_routed(moe: MoE, x_TD: jax.Array, ids_TK: jax.Array, weights_TK: jax.Array) -> jax.Array:
    """The routed experts computed for every expert and weighted by the (sparse) combine weights: the same
    sum as the grouped kernel, which for a few small experts is faster on a CPU and simple to differentiate."""
    e = moe.experts
    T = x_TD.shape[0]
    combine = jnp.zeros((T, moe.n_experts), jnp.float32).at[jnp.arange(T)[:, None], ids_TK].add(weights_TK)
    h = swiglu(jnp.einsum("td,eid->tei", x_TD, e.w1[...]), jnp.einsum("td,eid->tei", x_TD, e.w3[...]), e.limit)
    return jnp.einsum("tei,edi->td", h * combine[..., None], e.w2[...])


def moe_ffn(moe: MoE, x_TD: jax.Array, ids_T: jax.Array, moe_compute: str) -> tuple[jax.Array, MoeStats]:
    """MoE output [T, D] and its stats: loads [E] and the balance loss sum_i f_i P_i, with
    f_i = E / (k T) * #tokens choosing i and P_i = mean_t s_{t,i} / sum_j s_{t,j} (DeepSeek-V3 eq. 17-19)."""
    sel, weights = moe.gate(x_TD, ids_T)
    if moe_compute == "dense":
        routed = dense_routed(moe, x_TD, sel, weights)
    else:
        routed = moe.experts(x_TD, sel, weights)
    y = (routed + moe.shared_experts(x_TD)).astype(x_TD.dtype)
    E, (T, k) = moe.n_experts, sel.shape
    scores = jnp.sqrt(jax.nn.softplus(dense(x_TD, moe.gate.weight[...], jnp.float32)))
    loads = jnp.zeros((E,), jnp.int32).at[sel.reshape(-1)].add(1)
    f = loads.astype(jnp.float32) * E / (k * T)
    P = jnp.mean(scores / jnp.sum(scores, axis=-1, keepdims=True), axis=0)
    return y, MoeStats(loads, jnp.sum(sg(f) * P))


def attention_input(block: Block, c: ModelConfig, s: Streams, engram_hashes: jax.Array | None
                    ) -> tuple[jax.Array, HcMix, jax.Array]:
    """`dsv41.block.attention_input` (V4.1) with the differentiable XLA mHC: (streams [T, n, D], attention mix,
    normed x)."""
    norm = block.attn_norm
    if s.pending is not None and block.engram is None:
        mix_ffn, y = s.pending
        R, x = mhc_post_pre(s.R, y, mix_ffn.post, mix_ffn.comb, s.pre, norm.weight[...], eps=norm.eps, impl="xla")
        return R, block.hc_attn(R), x
    R = s.R if s.pending is None else hc_post(s.R, *s.pending)
    if block.engram is not None:
        R = block.engram(R, engram_hashes[:, block.role.engram_index])
    u = R[:, 0] if s.pre is None else hc_collapse(R, s.pre)
    return R, block.hc_attn(R), norm(u)


def train_blocks(blocks, c: ModelConfig, R_TnD: jax.Array, ids_T: jax.Array, attend: Callable, *,
                 engram_hashes: jax.Array | None = None, capture: tuple[int, ...] = (), moe_compute: str = "dense"
                 ) -> tuple[jax.Array, dict[int, jax.Array], list[MoeStats]]:
    """`dsv41.block.run_blocks` with the MoE stats: (final collapse [T, D] before the output norm, the
    captured mean streams, one MoeStats per block)."""
    if not c.delayed_pre:
        raise ValueError("training covers V4.1 models (delayed_pre); this config is V4")
    s = Streams(R_TnD, None, None)
    captured: dict[int, jax.Array] = {}
    stats: list[MoeStats] = []
    for block in blocks:
        if block.role.layer_id in capture:
            captured[block.role.layer_id] = mean_stream(s)
        R, mix, x = attention_input(block, c, s, engram_hashes)
        y = attend(block, x)
        norm = block.ffn_norm
        R, x = mhc_post_pre(R, y, mix.post, mix.comb, mix.pre, norm.weight[...], eps=norm.eps, impl="xla")
        mix = block.hc_ffn(R)
        y, st = moe_ffn(block.ffn, x, ids_T, moe_compute)
        stats.append(st)
        s = Streams(R, mix.pre, (mix, y))
    R, pre = final_streams(s)
    return hc_collapse(R, pre), captured, stats


# ================================================================================= the losses
class BackboneOut(NamedTuple):
    lm: jax.Array  # mean next-token cross-entropy (nats)
    indexer_kl: jax.Array  # mean over index sources
    balance: jax.Array  # mean over MoE layers
    loads: jax.Array  # [layers, E] int32
    logits: jax.Array  # [T, V] float32
    features: jax.Array  # [T, len(dspark_target_layer_ids), D] DSpark target features


def backbone_forward(model, ids_T: jax.Array, targets_T: jax.Array, engram_hashes: jax.Array | None,
                     moe_compute: str = "dense", kl_stride: int = 1) -> BackboneOut:
    """One sequence from position 0: ids [T] predict targets [T] (the next tokens)."""
    c = model.config
    indexer_losses: list[jax.Array] = []
    e = model.embed(ids_T)
    R = jnp.broadcast_to(e[:, None, :], (e.shape[0], c.hc_mult, e.shape[1]))
    attend = backbone_attention(c, jnp.arange(ids_T.shape[0]), Published(), indexer_losses, kl_stride)
    h, captured, stats = train_blocks(model.layers, c, R, ids_T, attend, engram_hashes=engram_hashes,
                                      capture=c.dspark_target_layer_ids, moe_compute=moe_compute)
    logits = model.head(model.norm(h), jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    lm = -jnp.mean(jnp.take_along_axis(logp, targets_T[:, None], axis=-1))
    features = (jnp.stack([captured[k] for k in c.dspark_target_layer_ids], axis=1) if c.dspark_target_layer_ids
                else jnp.zeros((ids_T.shape[0], 0, c.hidden_size), jnp.float32))
    kl = jnp.mean(jnp.stack(indexer_losses)) if indexer_losses else jnp.zeros((), jnp.float32)
    return BackboneOut(lm, kl, jnp.mean(jnp.stack([s.balance for s in stats])),
                       jnp.stack([s.loads for s in stats]), logits, features)
