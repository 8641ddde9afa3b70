"""Bytes per device of a layout, from abstract shapes (nothing allocated): parameters under the rules table,
Engram staging, and the KV cache's records per token and per request slot. `sharding_report` prints it for one
layout, `memory_plan` sets it against the target devices, `full_size_lowering` lowers on its `abstract_mesh`.

Parameters: by default in the release checkpoint's formats (`weights="release"`: FP8 32x32-block linears, MXFP4
routed experts, BF16/F32 elsewhere, as they stay on the device); "dequantized" counts every weight in `dtype`. The
Engram tables (`engram.embed.weight` + `.scale`) live in host memory, one copy per host; the device holds staging
buffers for the rows a step gathers. KV: the runtime's cache layout (`CacheLayout`); a cached token's KV lives on
every tp rank of its request's dp rank (the single latent is replicated over tp), each dp rank holds its own
requests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType

from dsv41 import checkpoint
from dsv41.api import abstract_params
from dsv41.config import ModelConfig, load_config
from serving.bench.roofline import is_engram_table
from serving.runtime.kv_cache import CacheLayout
from sharding import rules
from sharding.mesh import MESH_AXES, ParallelConfig

WEIGHTS = ("release", "dequantized")


def _shard_factor(mesh, spec) -> int:
    n = 1
    for axes in spec:
        for a in (axes if isinstance(axes, tuple) else (axes,) if axes else ()):
            n *= mesh.shape[a]
    return n


def abstract_mesh(pc: ParallelConfig) -> AbstractMesh:
    f = pc.factors()
    return AbstractMesh(tuple(f[a] for a in MESH_AXES), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


@functools.lru_cache(maxsize=8)
def model_params(preset: str, weights: str = "release", dtype: str = "bfloat16"
                 ) -> dict[tuple, jax.ShapeDtypeStruct]:
    """{path: ShapeDtypeStruct} of every parameter as it sits in memory: `weights="release"` keeps the release
    checkpoint's formats (`checkpoint.release_formats`), "dequantized" decodes every linear to `dtype`. Engram
    tables are FP8 rows + UE8M0 scales either way (that is how a release checkpoint loads them)."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights {weights!r}: choose one of {WEIGHTS}")
    c = load_config(preset)
    engram_fp8 = bool(c.engram_layer_ids)
    _, dense = abstract_params(c, jnp.dtype(dtype), engram_fp8)
    if weights == "dequantized":
        return dense
    _, release = abstract_params(c, jnp.dtype(dtype), engram_fp8, checkpoint.release_formats(c, list(dense)))
    return release


def engram_staging_bytes(c: ModelConfig, max_num_batched_tokens: int) -> int:
    """Device bytes of the double-buffered staging of the Engram rows one step gathers (per dp rank's batch)."""
    if not c.engram_layer_ids:
        return 0
    hd = c.engram_head_dim
    return 2 * max_num_batched_tokens * len(c.engram_layer_ids) * c.engram_hash_cols * (hd + hd // 32)


def kv_bytes_per_request(layout: CacheLayout, max_model_len: int) -> int:
    """One request's KV at max_model_len tokens: whole blocks of global KV + index keys, plus its slot (SWA
    rings of every layer, ratio-2 compressor tails)."""
    return -(-max_model_len // layout.block_size) * layout.bytes_per_block() + layout.bytes_per_slot()


def memory_report(preset: str, pc: ParallelConfig, *, weights: str = "release", dtype: str = "bfloat16",
                  kv_format: str = "release", block_size: int = 256, max_num_batched_tokens: int = 8192,
                  max_model_len: int | None = None, num_requests: int | None = None) -> dict:
    """Bytes per device of a layout (nothing allocated). With max_model_len and num_requests (over the whole
    layout, spread evenly over the dp ranks): the KV bytes per device of that many full-length requests."""
    c = load_config(preset)
    pc.check_model(c)
    mesh = abstract_mesh(pc)
    params = model_params(preset, weights, dtype)
    total = per_device = engram = 0
    for path, s in params.items():
        nbytes = int(np.prod(s.shape)) * s.dtype.itemsize
        if is_engram_table(path):
            engram += nbytes
            continue
        total += nbytes
        per_device += nbytes // _shard_factor(mesh, rules.to_spec(mesh, rules.param_logical(path), s.shape))
    layout = CacheLayout(c, pc.data_parallel_size, block_size, pc.data_parallel_size, kv_format, dtype)
    replication = pc.tensor_parallel_size  # rows are replicated over tp, split over dp
    out = {"preset": preset, "layout": pc.describe(), "weights": weights, "param_dtype": dtype,
           "param_bytes_total": total, "param_bytes_per_device": per_device,
           "engram_table_bytes_per_host": engram,
           "engram_staging_bytes_per_device": engram_staging_bytes(c, max_num_batched_tokens),
           "max_num_batched_tokens": max_num_batched_tokens,
           "kv_format": kv_format, "block_size": block_size,
           "kv_global_bytes_per_token": layout.bytes_per_block() / block_size,
           "kv_swa_and_tail_bytes_per_request": layout.bytes_per_slot(),
           "kv_copies_per_token": replication,
           "kv_note": (f"a cached token's KV lives on the {replication} tp rank(s) of its request's dp rank: "
                       f"the single latent is replicated over tp (x{replication} memory per token)"),
           "replicated_fallbacks": rules.fallbacks(mesh, {p: s.shape for p, s in params.items()})}
    if max_model_len is not None and num_requests is not None:
        per_rank = -(-num_requests // pc.data_parallel_size)
        out.update(max_model_len=max_model_len, num_requests=num_requests, requests_per_dp_rank=per_rank,
                   kv_bytes_per_request=kv_bytes_per_request(layout, max_model_len),
                   kv_bytes_per_device=per_rank * kv_bytes_per_request(layout, max_model_len))
    return out
