"""Per-expert token counts out of a traced forward, for the expert load balancer (serving spec §5.4).

The MoE blocks return only their output, so the counts leave through a collector instead: a caller that
wants them opens `count_experts(valid_T)` around the layers it runs (inside the same trace as the MoE
calls: a jitted segment function), every `MoE` in that scope appends its [E] counts of the valid rows'
routed choices, and the caller returns the stacked list as an output of its own. Outside a collector the
MoE does nothing extra, so `Model.logits` and its compiled graph are unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp

_ACTIVE: contextvars.ContextVar[tuple[jax.Array, list] | None] = contextvars.ContextVar("expert_counts",
                                                                                         default=None)


def expert_counts(sel_Tk: jax.Array, valid_T: jax.Array, n_experts: int) -> jax.Array:
    """[E] int32: how many of the valid rows' choices went to each expert (padding rows count nothing)."""
    k = sel_Tk.shape[1]
    ones = jnp.broadcast_to(valid_T.astype(jnp.int32)[:, None], (sel_Tk.shape[0], k))
    return jnp.zeros((n_experts,), jnp.int32).at[sel_Tk.reshape(-1)].add(ones.reshape(-1))


@contextlib.contextmanager
def count_experts(valid_T: jax.Array) -> Iterator[list[jax.Array]]:
    """Collect each MoE layer's [E] counts (in call order) over the rows where `valid_T` [T] is true."""
    counts: list[jax.Array] = []
    token = _ACTIVE.set((valid_T, counts))
    try:
        yield counts
    finally:
        _ACTIVE.reset(token)


def record(sel_Tk: jax.Array, n_experts: int) -> None:
    """Called by the MoE with its logical expert choices [T, k]; a no-op outside `count_experts`."""
    active = _ACTIVE.get()
    if active is None:
        return
    valid_T, counts = active
    if valid_T.shape[0] != sel_Tk.shape[0]:
        raise ValueError(f"count_experts: valid mask has {valid_T.shape[0]} rows, the MoE routed {sel_Tk.shape[0]}")
    counts.append(expert_counts(sel_Tk, valid_T, n_experts))
