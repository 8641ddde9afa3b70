"""Routed-expert compute over the mesh: capacity-padded all-to-all dispatch and combine in a `shard_map`
(XLA:CPU has no ragged all-to-all, jax-notes §3), installed as `MoE.routed_compute`.

Per rank (tokens split over the expert axes, experts over the same axes, each expert's intermediate
dimension over the moe_tp axes):

  1. pack every (token, choice) pair into a send buffer [E, C, D] at slot (expert, rank of the pair among
     this rank's pairs for that expert);
  2. all_to_all over the expert axes -> [ep sources, E_local, C, D];
  3. every received row through its local expert with the rank's intermediate slice - the model's own
     grouped matmul (`pallas_kernels.moe_gmm.routed_experts`, empty slots skipped), so each row's
     arithmetic is the single-device model's;
  4. all_to_all back and gather each pair's row from its slot; sum over the k choices; then psum over moe_tp
     (the partial sums of the intermediate slices, only where that split exists): one [T, D] all-reduce per
     layer, not one over the capacity-padded buffers.

No token is dropped: C is the smallest of a few static capacity buckets (a ladder of halvings from the
worst case, every local token choosing the same expert) that holds the largest per-(rank, expert) count of
this step, computed from the routing before dispatch and agreed on by a pmax; `lax.switch` runs that
bucket's dispatch. Decode steps with balanced routing then move a fraction of the worst-case bytes.
With ep = 1 (the TP layout) the all-to-alls are local. On one device the dispatch gives the model's logits
bit for bit.

Called inside the runtime's per-rank `shard_map` (`sharding.runtime`: the dp axes already manual, each rank
holding different tokens), the dispatch splits tokens over the remaining expert axis only (tp_ep), and
where an expert's intermediate dimension is split over dp (ep < world with dp > ep) it first gathers the
tokens of the ranks that share those slices, so the partial sums it adds belong to the same tokens; each
rank keeps its own rows of the result.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, get_abstract_mesh

from dsv41.layers.expert_load import expert_counts
from dsv41.layers.moe import Experts
from pallas_kernels.moe_gmm import routed_experts
from sharding.mesh import EP_AXES, MESH_AXES, MOE_TP_AXES, axis_size


def capacity_ladder(bound: int, n_buckets: int) -> tuple[int, ...]:
    """Static capacities: bound, bound/2, ... (n_buckets of them, at least 1 row), ascending."""
    return tuple(sorted({max(1, -(-bound // 2 ** i)) for i in range(n_buckets)}))


@dataclass(frozen=True)
class ExpertDispatch:
    """`MoE.routed_compute` on `mesh`; hashable (it lives in the NNX graph definition)."""

    mesh: Mesh
    capacity_buckets: int = 3

    @property
    def ep(self) -> int:
        return axis_size(self.mesh, EP_AXES)

    def __call__(self, experts: Experts, x_TD: jax.Array, sel_Tk: jax.Array, weights_Tk: jax.Array) -> jax.Array:
        manual = set(get_abstract_mesh().manual_axes)  # the dp axes inside the runtime's per-rank shard_map
        split = tuple(a for a in EP_AXES if a not in manual)  # token shards of this dispatch
        gather = tuple(a for a in MOE_TP_AXES if a in manual and self.mesh.shape[a] > 1)
        inter = tuple(a for a in MOE_TP_AXES if a not in manual)
        if not manual:
            # Outside the per-rank runtime the tokens are replicated: pin that on both sides of the dispatch, or
            # XLA's propagation spreads its token split into the neighbouring mHC / norm ops, which then round
            # differently on fewer rows (float32 noise: docs/design/measurements.md).
            x_TD = jax.lax.with_sharding_constraint(x_TD, NamedSharding(self.mesh, P()))
        T = x_TD.shape[0]
        if hasattr(experts, "eplb_replicas"):  # EPLB placement: each choice -> one replica of its expert
            replicas, count = experts.eplb_replicas[...], experts.eplb_replica_count[...]
            sel_Tk = jnp.where(sel_Tk >= 0, replicas[sel_Tk, jnp.arange(T)[:, None] % count[sel_Tk]], -1)
        n_split = axis_size(self.mesh, split)
        T_pad = -(-T // n_split) * n_split
        pad = ((0, T_pad - T), (0, 0))
        x, sel, w = jnp.pad(x_TD, pad), jnp.pad(sel_Tk, pad, constant_values=-1), jnp.pad(weights_Tk, pad)
        valid = jnp.all(sel >= 0, axis=1)  # not this padding, nor the step's own (`MoE.routed` drops whole rows)
        if gather:  # the ranks sharing this rank's expert-intermediate slices: their tokens too
            x, sel, w, valid = (jax.lax.all_gather(a, gather, tiled=True) for a in (x, sel, w, valid))
        tok, e_spec = P(split, None), P(split, inter, None)
        body = functools.partial(_dispatch_compute, ep=self.ep, limit=experts.limit, impl=experts.kernel_impl,
                                 moe_tp=tuple(a for a in MOE_TP_AXES if self.mesh.shape[a] > 1),
                                 ladder=capacity_ladder(x.shape[0] // n_split, self.capacity_buckets))
        y = jax.shard_map(body, mesh=None if manual else self.mesh,
                          in_specs=(tok, tok, tok, P(split), e_spec, e_spec, P(split, None, inter)),
                          out_specs=tok, axis_names=set(MESH_AXES) - manual, check_vma=False)(
            x, sel, w, valid, *experts.weights())
        if gather:
            y = jax.lax.dynamic_slice_in_dim(y, jax.lax.axis_index(gather) * T_pad, T_pad)
        if not manual:
            return jax.lax.with_sharding_constraint(y[:T], NamedSharding(self.mesh, P()))
        return y[:T]


def _slots(sel_Tk: jax.Array, valid_T: jax.Array, n_experts: int) -> jax.Array:
    """[T, k] int32: each pair's rank among this rank's pairs for its expert (invalid pairs: a large
    out-of-range slot, dropped by the scatter)."""
    T, k = sel_Tk.shape
    onehot = jax.nn.one_hot(sel_Tk.reshape(-1), n_experts, dtype=jnp.int32)
    pos = jnp.take_along_axis(jnp.cumsum(onehot, axis=0) - 1, sel_Tk.reshape(-1, 1), axis=1).reshape(T, k)
    return jnp.where(valid_T[:, None], pos, jnp.iinfo(jnp.int32).max)


def _dispatch_compute(x_TD, sel_Tk, w_Tk, valid_T, w1_EID, w3_EID, w2_EDI, *, ep: int, limit: float, impl: str,
                      moe_tp: tuple[str, ...], ladder: tuple[int, ...]):
    E = w1_EID.shape[0] * ep
    pos_Tk = _slots(sel_Tk, valid_T, E)
    need = jax.lax.pmax(jnp.max(expert_counts(sel_Tk, valid_T, E)), MESH_AXES)
    bucket = jnp.sum(jnp.asarray(ladder) < need)  # the smallest capacity >= need
    branches = [functools.partial(_dispatch_at_capacity, C=C, ep=ep, limit=limit, impl=impl, moe_tp=moe_tp)
                for C in ladder]
    return jax.lax.switch(bucket, branches, x_TD, sel_Tk, pos_Tk, w_Tk, w1_EID, w3_EID, w2_EDI)


def _dispatch_at_capacity(x_TD, sel_Tk, pos_Tk, w_Tk, w1_EID, w3_EID, w2_EDI, *, C: int, ep: int, limit: float,
                          impl: str, moe_tp: tuple[str, ...]):
    T, D = x_TD.shape
    k = sel_Tk.shape[1]
    E_local = w1_EID.shape[0]
    E = E_local * ep
    x_rows = jnp.broadcast_to(x_TD[:, None, :], (T, k, D))
    send_ECD = jnp.zeros((E, C, D), x_TD.dtype).at[sel_Tk, pos_Tk].set(x_rows, mode="drop")
    send_w_EC = jnp.zeros((E, C), jnp.float32).at[sel_Tk, pos_Tk].set(w_Tk, mode="drop")
    # each slot's expert as the receiving rank numbers it; unused slots keep E_local (out of range: skipped)
    send_id_EC = jnp.full((E, C), E_local, jnp.int32).at[sel_Tk, pos_Tk].set(sel_Tk % E_local, mode="drop")
    with jax.named_scope("moe_dispatch"):
        recv_SECD = jax.lax.all_to_all(send_ECD.reshape(ep, E_local, C, D), EP_AXES, 0, 0, tiled=True)
        recv_w_SEC = jax.lax.all_to_all(send_w_EC.reshape(ep, E_local, C), EP_AXES, 0, 0, tiled=True)
        recv_id_SEC = jax.lax.all_to_all(send_id_EC.reshape(ep, E_local, C), EP_AXES, 0, 0, tiled=True)
    with jax.named_scope("moe_experts"):
        out_SECD = _received_experts(recv_SECD, recv_id_SEC, recv_w_SEC, w1_EID, w3_EID, w2_EDI, limit=limit,
                                     impl=impl)
    with jax.named_scope("moe_combine"):
        back_ECD = jax.lax.all_to_all(out_SECD, EP_AXES, 0, 0, tiled=True).reshape(E, C, D)
        rows_TkD = back_ECD.at[sel_Tk, pos_Tk].get(mode="fill", fill_value=0.0)
        y_TD = jnp.sum(rows_TkD, axis=1)  # over the k choices in float32, as moe_gmm's combine
    if moe_tp:
        # The partial sums over the intermediate slices, reduced once per token after the combine: [T, D], not
        # the capacity-padded [E_local, C, D] (at full size 1.3 MB instead of 503 MB per layer of a TP4 decode
        # step). An all-reduce over one device still costs a copy on XLA:CPU, hence the condition.
        y_TD = jax.lax.psum(y_TD, moe_tp)
    return y_TD


def _received_experts(x_SECD, id_SEC, w_SEC, w1_EID, w3_EID, w2_EDI, *, limit: float, impl: str) -> jax.Array:
    """Every received row through its local expert `id_SEC` (E_local on unused slots), float32 [S, E_local,
    C, D] (zeros on unused slots, which are skipped, not computed).

    The rows go through `moe_gmm.routed_experts` as single-choice pairs, so each row's arithmetic (matmul
    shapes and casts, where the router weight is applied, the dtype of h before w2) is the one the
    single-device model runs; only the sums over the k choices and over the intermediate slices (psum over
    moe_tp) happen outside it."""
    S, E_local, C, D = x_SECD.shape
    y_PD = routed_experts(x_SECD.reshape(-1, D), id_SEC.reshape(-1, 1), w_SEC.reshape(-1, 1), w1_EID, w3_EID,
                          w2_EDI, limit=limit, impl=impl)
    return y_PD.reshape(S, E_local, C, D)
