"""The serving runtime on a mesh: data-parallel attention with per-rank batches and KV caches.

`Runner(ShardedModel(...), rc, placement=MeshPlacement(mesh))` runs its segment functions once per
data-parallel rank inside one `shard_map` over the dp axes (`per_rank`): each rank gets its own batch (its
requests only, slots and block ids local to the rank), its own slice of the KV cache and of the step's
carried rows, so attention never leaves the rank. The tensor-parallel axes stay automatic inside (heads and
the O-projection split by the parameter shardings, XLA inserts the all-reduces; the one opaque call there,
the Pallas attention kernel, gets its own shard_map over the heads: `on_local_heads`), and the MoE layers'
dispatch reaches across ranks with all-to-alls over the expert axes (`sharding.expert_dispatch` sees the dp
axes manual and gathers tokens only where an expert's intermediate dimension is split over dp).

Global arrays put the ranks one after another on their first dimension: the cache is [ranks x slots, ...]
and [ranks x blocks, ...], a batch array [ranks, ...], logits [ranks x max_num_seqs, vocab]; all of these
are split over the dp axes by the rules table ("requests"). Expert counts are summed over the ranks and
sampled tokens replicated, so every process of a multi-process run can read them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, get_abstract_mesh

from sharding import rules
from sharding.mesh import DP_AXES, axis_size

# What a rank function's outputs are, for `per_rank`: a cache (split over the ranks like its input), rows
# (each rank's block, concatenated on the first dimension), or a per-rank sum (added over the ranks).
OUTPUT_KINDS = ("cache", "rows", "sum")


def _manual(spec: P) -> P:
    """The part of a PartitionSpec over the dp axes (what the per-rank shard_map splits by hand)."""
    out = []
    for entry in spec:
        axes = entry if isinstance(entry, tuple) else (entry,) if entry else ()
        kept = tuple(a for a in axes if a in DP_AXES)
        out.append(kept if kept else None)
    return P(*out)


@dataclass(frozen=True)
class MeshPlacement:
    mesh: Mesh

    @property
    def ranks(self) -> int:
        return axis_size(self.mesh, DP_AXES)

    @property
    def replicated(self) -> NamedSharding:
        return rules.replicated(self.mesh)

    def rows_sharding(self, ndim: int) -> NamedSharding:
        """A rank-stacked array: first dimension split over the dp axes."""
        return NamedSharding(self.mesh, rules.to_spec(self.mesh, ("requests",) + (None,) * (ndim - 1),
                                                      (self.ranks,) + (1,) * (ndim - 1)))

    def global_specs(self, rank_shapes, *, cache: bool = False):
        """Every rank's copy of `rank_shapes` (ShapeDtypeStructs of one rank) one after another on the first
        dimension, as ShapeDtypeStructs with their shardings (`cache`: the KV cache's rule)."""
        shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct((self.ranks * s.shape[0], *s.shape[1:]), s.dtype),
                              rank_shapes)
        if cache:
            shardings = rules.cache_shardings(self.mesh, shapes)
        else:
            shardings = jax.tree.map(lambda s: self.rows_sharding(len(s.shape)), shapes)
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)

    def zeros(self, rank_shapes, *, cache: bool = False):
        """Global zero arrays holding every rank's copy of `rank_shapes` (ShapeDtypeStructs of one rank) one
        after another on the first dimension, created in place on their shardings."""
        return zeros_like(self.global_specs(rank_shapes, cache=cache))

    def put_batch(self, batch):
        """A rank-stacked host batch (a pytree of [ranks, ...] arrays) onto the devices, each rank's row on its
        devices."""
        return rules.place(batch, jax.tree.map(lambda a: self.rows_sharding(max(1, np.ndim(a))), batch))

    def put_replicated(self, tree):
        return rules.place(tree, jax.tree.map(lambda _: self.replicated, tree))

    def per_rank(self, fn: Callable, leaves: Sequence[jax.Array], outputs: Sequence[str]) -> Callable:
        """fn(leaves, cache, carry, batch, *replicated) of ONE rank (its cache, carry and batch arrays without the
        rank dimension; arrays every rank reads whole, e.g. the previous step's sampled tokens) -> the same over
        the global arrays, run on every rank at once. `outputs` names each of fn's outputs' kind (OUTPUT_KINDS)."""
        if any(k not in OUTPUT_KINDS for k in outputs):
            raise ValueError(f"output kinds {outputs}: each must be one of {OUTPUT_KINDS}")
        leaf_specs = [_manual(a.sharding.spec) if isinstance(getattr(a, "sharding", None), NamedSharding) else P()
                      for a in leaves]
        ranked = P(DP_AXES)

        def body(leaves, cache, carry, batch, *replicated):
            outs = fn(leaves, cache, carry, jax.tree.map(lambda a: a[0], batch), *replicated)
            return tuple(None if o is None else jax.tree.map(lambda x: jax.lax.psum(x, DP_AXES), o) if k == "sum"
                         else o for o, k in zip(outs, outputs))

        out_specs = tuple(P() if k == "sum" else ranked for k in outputs)

        def run(leaves, cache, carry, batch, *replicated):
            return jax.shard_map(body, mesh=self.mesh, in_specs=(leaf_specs, ranked, ranked, ranked,
                                                                 *(P(),) * len(replicated)),
                                 out_specs=out_specs, axis_names=set(DP_AXES), check_vma=False)(
                leaves, cache, carry, batch, *replicated)

        return run


def zeros_like(specs):
    """Zero arrays of `specs` (ShapeDtypeStructs), each created in place on its sharding (or the default device)."""
    shardings = jax.tree.map(lambda s: s.sharding, specs)
    return jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), specs), out_shardings=shardings)()


def on_local_heads(kernel: Callable, q_THd: jax.Array, sink_H: jax.Array, *replicated) -> jax.Array:
    """kernel(q_THd, sink_H, *replicated) -> [T, H, d], run on each tensor-parallel rank's own heads.

    XLA's partitioner cannot split a custom call (a Pallas kernel on GPU): with the heads split over tp it
    would gather the queries and run every head on every device. Under a mesh that splits the heads (the
    tracing context's, i.e. inside `per_rank`) the kernel goes into a shard_map over the head axes instead:
    each rank its heads' queries and sinks, the (replicated) KV and metadata whole. Elsewhere it runs as is."""
    mesh = get_abstract_mesh()
    axes = () if mesh.empty else tuple(a for a in rules.LOGICAL_TO_MESH["heads"]
                                       if mesh.shape.get(a, 1) > 1 and a not in mesh.manual_axes)
    if not axes or q_THd.shape[1] % axis_size(mesh, axes):
        return kernel(q_THd, sink_H, *replicated)
    heads = P(None, axes, None)
    return jax.shard_map(kernel, mesh=None, in_specs=(heads, P(axes), *(P(),) * len(replicated)), out_specs=heads,
                         axis_names=set(axes), check_vma=False)(q_THd, sink_H, *replicated)
