"""MoE FFN (spec §2.8): sqrt(softplus) router, bias used only for selection, renormalized weights x
routed_scaling_factor, clamped SwiGLU experts, one shared expert. V4 compat: hash-routed layers take
their experts from `tid2eid[token]` (weights still from the scores).

The routed experts run as a grouped matmul over the (token, choice) pairs sorted by expert
(`pallas_kernels.moe_gmm`: a Pallas kernel on GPU, a tiled XLA path on CPU in `moe_xla`), so a token costs its k
experts, not all E.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41.layers.basic import Linear, matmul_precision
from pallas_kernels.expert_weights import (
    MXFP4_BLOCK,
    QuantizedExperts,
    reference_dequantize,
)
from pallas_kernels.kernel_config import KernelConfig, MoeStep
from pallas_kernels.moe_gmm import routed_experts
from pallas_kernels.router import route
from pallas_kernels.tile_table import KernelShape


def swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    """silu(min(gate, limit)) * clamp(up, -limit, limit), float32."""
    g = jnp.minimum(gate.astype(jnp.float32), limit)
    u = jnp.clip(up.astype(jnp.float32), -limit, limit)
    return jax.nn.silu(g) * u


class Router(nnx.Module):
    """gate.weight [E, D]; gate.bias [E] (float32, selection only) or V4 hash layers' tid2eid [V, k].

    Bias-routed layers go through `pallas_kernels.router.route` with the implementation of `kernels` (static;
    given by `dsv41.layers.basic.with_kernels`)."""

    def __init__(self, dim: int, n_experts: int, top_k: int, scaling: float, *, hash_vocab: int | None,
                 dtype: jnp.dtype):
        self.top_k, self.scaling = top_k, scaling
        self.kernels = KernelConfig()
        self.weight = nnx.Param(jnp.zeros((n_experts, dim), dtype))
        if hash_vocab is None:
            self.bias = nnx.Param(jnp.zeros((n_experts,), jnp.float32))
            self.tid2eid = None
        else:
            self.bias = None
            self.tid2eid = nnx.Param(jnp.zeros((hash_vocab, top_k), jnp.int32))

    @property
    def kernel_impl(self) -> str:
        return self.kernels.impl

    def __call__(self, x_TD: jax.Array, ids_T: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Expert ids [T, k] and combine weights [T, k] (float32)."""
        w = self.weight[...]
        if self.tid2eid is None:
            return route(x_TD, w, self.bias[...], top_k=self.top_k, scaling=self.scaling, impl=self.kernel_impl)
        logits = jnp.einsum("td,ed->te", x_TD.astype(w.dtype), w, preferred_element_type=jnp.float32,
                            precision=matmul_precision(w.dtype))
        scores = jnp.sqrt(jax.nn.softplus(logits))
        sel = jnp.take(self.tid2eid[...], ids_T, axis=0)
        weights = jnp.take_along_axis(scores, sel, axis=-1)
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
        return sel, weights * self.scaling


class Experts(nnx.Module):
    """Routed experts stacked: w1, w3 [E, I, D], w2 [E, D, I] (release: ffn.experts.e.w{1,2,3}).

    `store_mxfp4()` keeps them in the release's MXFP4 format on the device: `w1` = the packed e2m1 bytes
    [E, I, D/2] and `w1_scale` the UE8M0 bytes [E, I, D/32] (likewise w3, w2), read by the grouped matmul,
    which decodes the tiles it loads (`pallas_kernels.expert_weights`).

    The grouped matmul runs the implementation of `kernels` and, on the XLA path, its form for this call's shape
    where that is a small step (`KernelConfig.small_step_form`; static, given by
    `dsv41.layers.basic.with_kernels`)."""

    NAMES = ("w1", "w3", "w2")

    def __init__(self, n_experts: int, dim: int, inter: int, limit: float, *, dtype: jnp.dtype):
        self.limit = limit
        self.kernels = KernelConfig()
        self.weight_kind: str | None = None  # None: float weights; "mxfp4": release records
        self.w1 = nnx.Param(jnp.zeros((n_experts, inter, dim), dtype))
        self.w3 = nnx.Param(jnp.zeros((n_experts, inter, dim), dtype))
        self.w2 = nnx.Param(jnp.zeros((n_experts, dim, inter), dtype))
        self.w1_scale = self.w3_scale = self.w2_scale = nnx.data(None)

    def store_mxfp4(self) -> None:
        for name in self.NAMES:
            E, O, In = getattr(self, name)[...].shape
            setattr(self, name, nnx.Param(jnp.zeros((E, O, In // 2), jnp.uint8)))
            setattr(self, name + "_scale", nnx.Param(jnp.zeros((E, O, In // MXFP4_BLOCK), jnp.uint8)))
        self.weight_kind = "mxfp4"

    def store_float(self, dtype: jnp.dtype) -> None:
        """Decode MXFP4 experts to float `dtype` in place (for a mesh that cannot split their 32-channel blocks)."""
        if self.weight_kind is None:
            return
        for name, w in zip(self.NAMES, self.weights()):
            setattr(self, name, nnx.Param(reference_dequantize(w).astype(dtype)))
            setattr(self, name + "_scale", nnx.data(None))
        self.weight_kind = None

    @property
    def kernel_impl(self) -> str:
        return self.kernels.impl

    def small_step(self, rows: int, top_k: int) -> MoeStep | None:
        """The shape of a call on `rows` rows of `top_k` choices, as `KernelConfig.moe_small_steps` lists it (None:
        quantized experts, which never take a small-step form)."""
        if self.weight_kind is not None:
            return None
        w1 = self.w1.get_value()
        E, I, D = w1.shape
        return MoeStep(rows, top_k, E, I, D, jnp.dtype(w1.dtype).name)

    def weights(self) -> tuple:
        """(w1, w3, w2) as the grouped matmul takes them: float arrays or `QuantizedExperts`."""
        if self.weight_kind is None:
            return tuple(getattr(self, n)[...] for n in self.NAMES)
        return tuple(QuantizedExperts(getattr(self, n)[...], getattr(self, n + "_scale")[...], self.weight_kind)
                     for n in self.NAMES)

    def __call__(self, x_TD: jax.Array, ids_TK: jax.Array, weights_TK: jax.Array) -> jax.Array:
        """sum_j weights[t, j] * expert_{ids[t, j]}(x_t), float32 [T, D]."""
        step = self.small_step(*ids_TK.shape)
        form = self.kernels.moe_small_step_form if step is None else self.kernels.small_step_form(step)
        w1 = self.w1.get_value()
        call = KernelShape("moe_gmm", ids_TK.shape[0], w1.shape, self.weight_kind or jnp.dtype(w1.dtype).name,
                           jnp.dtype(x_TD.dtype).name)
        return routed_experts(x_TD, ids_TK, weights_TK, *self.weights(), limit=self.limit, impl=self.kernels.impl,
                              small_steps=form, choice=self.kernels.choice(call))


class SharedExpert(nnx.Module):
    """ffn.shared_experts.w1/w3 [I, D], w2 [D, I]."""

    def __init__(self, dim: int, inter: int, limit: float, *, dtype: jnp.dtype):
        self.limit = limit
        self.w1 = Linear(dim, inter, dtype=dtype)
        self.w3 = Linear(dim, inter, dtype=dtype)
        self.w2 = Linear(inter, dim, dtype=dtype)

    def __call__(self, x_TD: jax.Array) -> jax.Array:
        h = swiglu(self.w1(x_TD, jnp.float32), self.w3(x_TD, jnp.float32), self.limit)
        return self.w2(h.astype(x_TD.dtype), jnp.float32)


class MoE(nnx.Module):
    def __init__(self, dim: int, n_experts: int, top_k: int, inter: int, scaling: float, limit: float, *,
                 hash_vocab: int | None, dtype: jnp.dtype):
        self.n_experts = n_experts
        self.gate = Router(dim, n_experts, top_k, scaling, hash_vocab=hash_vocab, dtype=dtype)
        self.experts = Experts(n_experts, dim, inter, limit, dtype=dtype)
        self.shared_experts = SharedExpert(dim, inter, limit, dtype=dtype)
        # Optional replacement of the routed-expert compute, (experts, x [T, D], expert ids [T, k], weights
        # [T, k]) -> float32 [T, D]: the hook through which `sharding` installs its expert dispatch.
        self.routed_compute = None

    def __call__(self, x_TD: jax.Array, ids_T: jax.Array) -> jax.Array:
        return self.routed(x_TD, ids_T)[0]

    def routed(self, x_TD: jax.Array, ids_T: jax.Array, valid_T: jax.Array | None = None
               ) -> tuple[jax.Array, jax.Array]:
        """(output [T, D], the router's logical expert choices [T, k] - before any EPLB replica mapping, what
        the expert load balancer counts).

        valid_T [T] bool: the rows to route (a serving step's real rows); the others (its padding, whose output
        nobody reads) get the shared expert only: their choices are dropped (id -1) before the routed experts,
        so they add no expert weights to a decode step's reads nor pairs to its products."""
        sel, weights = self.gate(x_TD, ids_T)
        routed_sel = sel if valid_T is None else jnp.where(valid_T[:, None], sel, -1)
        if self.routed_compute is not None:
            routed = self.routed_compute(self.experts, x_TD, routed_sel, weights)
        else:
            routed = self.experts(x_TD, routed_sel, weights)
        return (routed + self.shared_experts(x_TD)).astype(x_TD.dtype), sel
