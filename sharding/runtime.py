"""The serving runtime on a mesh: where the Runner puts its KV cache and its other device state.

`Runner(ShardedModel(...), rc, placement=MeshPlacement(mesh))` runs the same precompiled segments with
the parameters sharded by the rules, the cache sharded by `rules.CACHE_RULES` (slots and blocks over the
data-parallel axes; replicated over tp: the single KV latent) and the step's carry and logits replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

from jax.sharding import Mesh, NamedSharding

from sharding import rules


@dataclass(frozen=True)
class MeshPlacement:
    mesh: Mesh

    def cache_shardings(self, shapes: dict) -> dict:
        return rules.cache_shardings(self.mesh, shapes)

    @property
    def replicated(self) -> NamedSharding:
        return rules.replicated(self.mesh)
