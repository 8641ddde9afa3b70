"""A `dsv41.Model` placed on a mesh: parameters sharded by the rules table, every MoE layer's routed
compute replaced by the all-to-all dispatch, the forward one `jax.jit` over the sharded leaves (XLA's
partitioner inserts the attention all-reduces from the parameter shardings).

`ShardedModel` offers what `serving.runtime.runner.Runner` reads from a model (`module`, `config`,
`dtype`, `engram`, `token_map`), so a Runner built on it runs the same layout.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

import dsv41
from dsv41.layers.moe import Experts, MoE
from dsv41.model import forward
from sharding import rules
from sharding.expert_dispatch import ExpertDispatch
from sharding.mesh import ParallelConfig, make_mesh


@jax.jit
def _gather_slots(w_E: jax.Array, phys_to_log_P: jax.Array) -> jax.Array:
    """Physical expert weights [P, ...] from the logical ones [E, ...] (one compilation per weight shape)."""
    return jnp.take(w_E, phys_to_log_P, axis=0)


def _forward_leaves(graphdef, treedef, leaves, ids_T, hashes, *, fake_quant: bool):
    return forward(nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves)), ids_T, hashes, fake_quant=fake_quant)


class ShardedModel:
    def __init__(self, model: dsv41.Model, pc: ParallelConfig, mesh: Mesh | None = None, *,
                 capacity_buckets: int = 3):
        pc.check_model(model.config)
        self.parallel, self.mesh = pc, mesh if mesh is not None else make_mesh(pc)
        self.base = model
        self.config, self.dtype, self.engram, self.token_map = model.config, model.dtype, model.engram, model.token_map
        self.engram_tables = model.engram_tables  # host memory: one mapping for every rank of this process
        module = nnx.merge(*nnx.split(model.module))  # new module objects over the same arrays
        self.decoded_experts = decode_unsplittable_experts(module, self.mesh, model.dtype)
        graphdef, state = nnx.split(module)
        host = {tuple(k): v.get_value() for k, v in nnx.to_flat_state(state)}
        shapes = {p: tuple(a.shape) for p, a in host.items()}
        self.shardings = rules.param_shardings(self.mesh, shapes)
        self.replicated_fallbacks = rules.fallbacks(self.mesh, shapes)
        self.params = {p: rules.place(a, self.shardings[p]) for p, a in host.items()}
        self.module = nnx.merge(graphdef, nnx.from_flat_state([(p, nnx.Param(v)) for p, v in self.params.items()]))
        self.dispatch = ExpertDispatch(self.mesh, capacity_buckets)
        install_dispatch(self.module, self.dispatch)
        self._split()

    def apply_placement(self, placement) -> None:
        """Lay the backbone's routed experts out as `placement` (sharding.eplb.Placement, slots of rank r
        contiguous): physical weights gathered from the logical ones, the replica tables beside them.
        The first call adds the tables (a new graph); later calls only change values, so a Runner built
        after the first call keeps its compiled steps (`Runner.reload_params()` between steps). The replica
        table is as wide as the most replicas any placement with these slots can give (1 + redundant slots),
        so its shape does not change either."""
        table, count = placement.replicas(width=1 + placement.phys_to_log.shape[1] - self.config.n_routed_experts)
        for l, block in enumerate(self.module.layers):
            ex = block.ffn.experts
            for name in ("w1", "w2", "w3", "w1_scale", "w2_scale", "w3_scale"):
                path = ("layers", l, "ffn", "experts", name)
                if path not in self.params:  # float experts have no exponent bytes
                    continue
                w = _gather_slots(self.params[path], placement.phys_to_log[l])
                setattr(ex, name, nnx.Param(jax.device_put(w, self.shardings[path])))
            ex.eplb_replicas = nnx.Variable(rules.place(table[l], rules.replicated(self.mesh)))
            ex.eplb_replica_count = nnx.Variable(rules.place(count[l], rules.replicated(self.mesh)))
        self._split()

    def _split(self) -> None:
        """Leaves of the module; a new jitted forward only when the graph changed (not on a migration)."""
        graphdef, state = nnx.split(self.module)
        self._leaves, treedef = jax.tree.flatten(state)
        if (graphdef, treedef) != getattr(self, "_graph", None):
            self._graph = (graphdef, treedef)
            self._fn = jax.jit(functools.partial(_forward_leaves, graphdef, treedef),
                               static_argnames=("fake_quant",), out_shardings=rules.replicated(self.mesh))

    def leaves(self) -> list[jax.Array]:
        return self._leaves

    @property
    def forward_compilations(self) -> int:
        """Compiled variants of the forward so far (an expert migration must not add one)."""
        return self._fn._cache_size()

    def logits(self, input_ids, *, fake_quant: bool = False) -> np.ndarray:
        """As `dsv41.Model.logits`: [T] ids -> [T, vocab] float32 ([B, T] -> [B, T, vocab])."""
        ids = self.base._check_ids(input_ids)
        if ids.ndim == 2:
            return np.stack([self.logits(row, fake_quant=fake_quant) for row in ids])
        out = self._fn(self._leaves, jnp.asarray(ids, jnp.int32), self.base.engram_input(ids), fake_quant=fake_quant)
        return np.asarray(out.addressable_data(0))  # replicated: every process holds all of it

    def lower_logits(self, n_tokens: int):
        """The lowered prefill of n_tokens ids (for HLO inspection)."""
        ids = jax.ShapeDtypeStruct((n_tokens,), jnp.int32)
        engram = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                              self.base.engram_input(np.zeros(n_tokens, np.int64)))
        return self._fn.lower(self._leaves, ids, engram, fake_quant=False)


def decode_unsplittable_experts(module: nnx.Module, mesh: Mesh, dtype) -> list[str]:
    """MXFP4 experts whose exponent bytes (one per 32 input channels) cannot be split like their values on this
    mesh - an expert-TP split of fewer than 32 intermediate channels, only in test-size models - are decoded to
    `dtype` instead (the layout still runs, in more memory); returns their paths."""
    out = []
    for path, m in nnx.iter_modules(module):
        if not isinstance(m, Experts) or m.weight_kind is None:
            continue
        for name in Experts.NAMES:
            p = tuple(path) + (name,)
            values, scales = getattr(m, name)[...].shape, getattr(m, name + "_scale")[...].shape
            if (rules.to_spec(mesh, rules.param_logical(p), values)
                    != rules.to_spec(mesh, rules.param_logical(p[:-1] + (name + "_scale",)), scales)):
                m.store_float(dtype)
                out.append(rules.path_key(tuple(path)))
                break
    return sorted(set(out))


def install_dispatch(module: nnx.Module, dispatch: ExpertDispatch) -> int:
    """Set `routed_compute` on every MoE whose expert count the expert axes divide (the others, e.g. a
    drafter with fewer experts than ranks, keep the replicated reference compute); returns how many."""
    n = 0
    for _, m in nnx.iter_modules(module):
        if isinstance(m, MoE) and m.n_experts % dispatch.ep == 0:
            m.routed_compute = dispatch
            n += 1
    return n
