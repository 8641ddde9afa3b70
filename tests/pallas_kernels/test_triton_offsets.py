"""`pallas_kernels.triton_offsets`: every load / store of an array of 2**31 elements or more gets int64 offsets
in the Triton lowering - the V4.1-Flash MXFP4 expert stacks (2.26 GB each) and a 2.4 GB NVFP4 row cache, read
with int32 offsets, read before the array's start on an H200 - and smaller arrays keep int32 offsets. Lowered
for an abstract H200 with ShapeDtypeStructs: nothing is allocated."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax._src.pallas.triton import lowering as triton_lowering
from jax.experimental import pallas as pl

from dsv41.config import ModelConfig
from pallas_kernels import lowering, moe_gmm, triton_offsets
from pallas_kernels import sparse_attention as sa
from pallas_kernels.expert_weights import QuantizedExperts

S = jax.ShapeDtypeStruct


def _spy(rule, seen: dict):
    """`rule` recording {array shape: offset element types} in `seen`."""
    def spy(block_info, nd_indexer):
        result = rule(block_info, nd_indexer)
        offsets = result[0] if isinstance(result, tuple) else result  # jax 0.12 also returns a bounds mask
        kind = "i64" if "i64" in str(offsets.type) else "i32" if "i32" in str(offsets.type) else str(offsets.type)
        seen.setdefault(tuple(block_info.full_shape_dtype.shape), set()).add(kind)
        return result

    return spy


@pytest.fixture
def offset_types(monkeypatch):
    """{array shape: offset element types the (patched) lowering used for it}, filled while lowering."""
    seen = {}
    monkeypatch.setattr(triton_lowering, "_compute_offsets_from_indices",
                        _spy(triton_lowering._compute_offsets_from_indices, seen))
    return seen


def _gather_rows(x, i):
    """x[i, :16] of a [rows, 256] uint8 array, as a Triton kernel."""
    def kernel(x_ref, i_ref, o_ref):
        o_ref[...] = x_ref[i_ref[0], pl.ds(0, 16)]

    return pl.pallas_call(kernel, out_shape=S((16,), jnp.uint8), interpret=False,
                          in_specs=[pl.BlockSpec(x.shape, lambda: (0, 0)), pl.BlockSpec((1,), lambda: (0,))],
                          out_specs=pl.BlockSpec((16,), lambda: (0,)))(x, i)


@pytest.mark.parametrize("rows,want", [(1 << 20, "i32"), (9 << 20, "i64"), (17 << 20, "i64")])
def test_byte_arrays_past_int32_elements_get_int64_offsets(offset_types, rows, want):
    """256 MiB: int32; 2.25 GiB (what jax alone lowers with int32 offsets): int64; 4.25 GiB (jax's own int64)."""
    lowering.lower_for_cuda(_gather_rows, S((rows, 256), jnp.uint8), S((1,), jnp.int32))
    assert offset_types[(rows, 256)] == {want}


def test_jax_alone_still_uses_int32_offsets_between_2_and_4_gib(monkeypatch):
    """The bug worked around, still in the installed jax: when this fails, jax has fixed it and the patch can go."""
    patched = triton_lowering._compute_offsets_from_indices
    assert patched.widened  # applied by importing pallas_kernels
    triton_offsets.apply()
    assert triton_lowering._compute_offsets_from_indices is patched  # idempotent: not wrapped twice
    seen = {}
    monkeypatch.setattr(triton_lowering, "_compute_offsets_from_indices", _spy(patched.original, seen))
    lowering.lower_for_cuda(_gather_rows, S((9 << 20, 256), jnp.uint8), S((1,), jnp.int32))
    assert seen[(9 << 20, 256)] == {"i32"}


@pytest.mark.parametrize("T_rows", [8, 4096])
def test_v41_flash_mxfp4_expert_stacks_are_read_with_int64_offsets(offset_types, T_rows):
    """w1 / w3 [384, 2304, 2560] and w2 [384, 5120, 1152] uint8: 2.26e9 elements each (experts 365-383 lie past
    element 2**31); their scales (1/16 the size) and the activations keep int32 offsets."""
    c = ModelConfig.preset("v41-flash")
    D, I, E, k = c.hidden_size, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok
    u8 = lambda *s: S(s, jnp.uint8)
    w13 = QuantizedExperts(u8(E, I, D // 2), u8(E, I, D // 32), "mxfp4")
    w2 = QuantizedExperts(u8(E, D, I // 2), u8(E, D, I // 32), "mxfp4")
    lowering.lower_for_cuda(moe_gmm.pallas, S((T_rows, D), jnp.bfloat16), S((T_rows, k), jnp.int32),
                            S((T_rows, k), jnp.float32), w13, w13, w2, limit=c.swiglu_limit, interpret=False)
    assert offset_types[(E, I, D // 2)] == offset_types[(E, D, I // 2)] == {"i64"}
    assert offset_types[(E, I, D // 32)] == offset_types[(E, D, I // 32)] == {"i32"}


def test_attention_row_cache_of_2_4_gb_is_read_with_int64_offsets(offset_types):
    """The NVFP4 row cache at 64 requests x 128K context ([131072, 64, 288] uint8, 2.4e9 elements), where the
    decode kernel faulted on the H200; the FP8 SWA ring beside it keeps int32 offsets."""
    T, R, H, d, K, rpb = 64, 64, 64, 512, 512, 64
    nb = R * (131072 // rpb)
    i32 = lambda *s: S(s, jnp.int32)
    meta = sa.AttnMeta(i32(T), i32(T), i32(R), i32(R), i32(R), i32(R, nb // R))
    args = (S((T, H, d), jnp.bfloat16), S((T, 32), jnp.float32), S((T, 32), jnp.float32), S((H,), jnp.float32),
            S((T, d), jnp.bfloat16), S((R, 128, 528), jnp.uint8), meta, S((nb, rpb, 288), jnp.uint8), i32(T, K))
    lowering.lower_for_cuda(sa.pallas, *args, interpret=False, splits=4)
    assert offset_types[(nb, rpb, 288)] == {"i64"} and offset_types[(R, 128, 528)] == {"i32"}
