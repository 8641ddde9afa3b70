"""Per-expert token counts of a MoE layer's routing: the expert load balancer's signal (serving spec §5.4) and
the expert dispatch's capacity check. The serving runtime counts the choices each MoE layer returns
(`MoE.routed`) over the step's valid rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def expert_counts(sel_Tk: jax.Array, valid_T: jax.Array, n_experts: int) -> jax.Array:
    """[E] int32: how many of the valid rows' choices went to each expert (padding rows count nothing)."""
    k = sel_Tk.shape[1]
    ones = jnp.broadcast_to(valid_T.astype(jnp.int32)[:, None], (sel_Tk.shape[0], k))
    return jnp.zeros((n_experts,), jnp.int32).at[sel_Tk.reshape(-1)].add(ones.reshape(-1))
