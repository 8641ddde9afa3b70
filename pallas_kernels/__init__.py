"""Fused ops of V4.1 serving as Pallas GPU kernels, with the spec reference and a CPU (XLA) path.

Every op module exposes `reference` (plain jnp from the spec), `xla` (the fast path on CPU), `pallas`
(the GPU kernel; interpreted off a GPU) and one dispatch function taking `impl="auto" | "reference" | "xla"
| "pallas"` (auto: pallas on a GPU backend, xla elsewhere); the routed experts keep their `xla` in `moe_xla`,
beside `moe_gmm`. The serving runtime calls the dispatch under every implementation, so the CPU runs the same op a
GPU runs; a model's choices travel as a `KernelConfig`. The package imports nothing of the model.
"""

from pallas_kernels import triton_offsets
from pallas_kernels.dispatch import IMPLS, resolve_impl
from pallas_kernels.expert_weights import QuantizedExperts, quantized_experts
from pallas_kernels.indexer import IndexMeta, index_topk
from pallas_kernels.kernel_config import KernelConfig, MoeStep
from pallas_kernels.mhc import mhc_post_pre
from pallas_kernels.moe_gmm import routed_experts
from pallas_kernels.router import route
from pallas_kernels.sparse_attention import AttnMeta, sparse_mla
from pallas_kernels.tiles import QueryTiles, plan_tiles

triton_offsets.apply()  # int64 offsets for 1-byte arrays of 2-4 GiB (a jax lowering bug; see the module)

__all__ = ["IMPLS", "resolve_impl", "KernelConfig", "MoeStep", "AttnMeta", "sparse_mla", "route", "IndexMeta",
           "index_topk", "mhc_post_pre", "routed_experts", "QuantizedExperts", "quantized_experts", "QueryTiles",
           "plan_tiles"]
