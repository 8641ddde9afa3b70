"""64-bit element offsets for every array of 2**31 elements or more in a Pallas Triton kernel.

JAX's Triton lowering (`_compute_offsets_from_indices`, jax 0.11-0.12) computes a load's or store's element
offset in int32 unless the array holds more than 2**32 *bytes*. Offsets count elements, so a one-byte array
(uint8 / FP8) of 2-4 GiB gets int32 offsets that overflow past element 2**31: the kernel reads before the
array's start. Found on an H200 (2026-12-04): V4.1-Flash's MXFP4 expert stacks are 2.26 GB per projection,
so the rows of experts 365-383 read other memory (the fused MoE's output was wrong from batch 8 on and right at
batch 1, where 6 experts are touched: docs/design/measurements.md), and the attention's 2.4 GB NVFP4 row cache at
64 x 128K context faulted (CUDA_ERROR_ILLEGAL_ADDRESS). `apply()` (run when `pallas_kernels` is
imported) makes the lowering use int64 offsets for such arrays too: it hands the original rule an array of the
same shape described as 4-byte elements, which only moves it past the 2**32-byte test (the offsets stay in
elements). Arrays under 2**31 elements keep int32 offsets.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

INT32_ELEMENTS = 2**31  # offsets of an array with more elements than int32 can hold need int64


def apply() -> None:
    """Patch the Triton lowering's offset rule (idempotent; nothing to patch where jaxlib has no Triton lowering)."""
    try:
        from jax._src.pallas.triton import lowering as triton_lowering
    except ImportError:
        return

    original = triton_lowering._compute_offsets_from_indices
    if getattr(original, "widened", False):
        return

    def offsets(block_info, nd_indexer):
        aval = block_info.full_shape_dtype
        if math.prod(aval.shape) >= INT32_ELEMENTS:
            block_info = dataclasses.replace(block_info, full_shape_dtype=aval.update(dtype=np.dtype(np.uint32)))
        return original(block_info, nd_indexer)

    offsets.widened, offsets.original = True, original
    triton_lowering._compute_offsets_from_indices = offsets
