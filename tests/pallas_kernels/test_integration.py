"""The model's fused ops (router, routed experts, mHC post + delayed-pre collapse + norm; in the runtime
also the sparse attention) through pallas_kernels: switching the implementation changes the tiny model's
logits - full-sequence and through the serving runtime's segments - by no more than float32 rounding, and
the fused mHC kernel is in the traced program exactly where the model runs that sequence, and only under
impl="pallas"."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

import dsv41
from dsv41.block import Block
from dsv41.layers.moe import Experts, Router, set_kernel_impl
from dsv41.model import forward
from serving.runtime.config import RuntimeConfig
from serving.runtime.runner import Runner
from tests.jaxpr_walk import equations
from tests.pallas_kernels.util import seeded_rng
from tests.serving.driver import Driver

TOL = dict(rtol=1e-4, atol=1e-4)
# A 13-row prefill in the 16-row bucket (window 8: decoder replay trims it to 8 rows after the cut) and
# decode steps in the 1-row bucket (the split-key decode form of the attention kernel).
RC = dict(max_num_seqs=1, max_num_batched_tokens=16, max_model_len=64, block_size=8, token_buckets=(1, 16))
KEYS = [(seg, T) for seg in ("seg1", "seg2") for T in RC["token_buckets"]]


@pytest.fixture(scope="module")
def tiny():
    return dsv41.random_model("tiny", seed=3)


def pallas_calls(closed_jaxpr, name: str) -> int:
    """Number of pallas_calls of kernel `name` in a traced program, nested jaxprs included."""
    return sum(e.primitive.name == "pallas_call" and e.params.get("name") == name for e in equations(closed_jaxpr))


def expected_fused_sites(blocks) -> int:
    """V4.1: every FFN input, and every attention input after the first block unless Engram sits between."""
    return sum(1 + (i > 0 and b.engram is None) for i, b in enumerate(blocks))


def test_model_logits_agree_across_impls(tiny):
    rng, msg = seeded_rng()
    ids = rng.integers(3, 500, 13).astype(np.int32)
    tiny.set_kernel_impl("reference")
    ref = tiny.logits(ids)
    try:
        for impl in ("xla", "pallas"):
            tiny.set_kernel_impl(impl)
            np.testing.assert_allclose(tiny.logits(ids), ref, **TOL, err_msg=f"{msg} {impl}")
    finally:
        tiny.set_kernel_impl("auto")
    assert all(m.kernel_impl == "auto" for _, m in nnx.iter_modules(tiny.module)
               if isinstance(m, (Router, Experts, Block)))


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas"])
def test_fused_mhc_only_under_pallas(tiny, impl):
    set_kernel_impl(tiny.module, impl)
    try:
        graphdef, state = nnx.split(tiny.module)
        ids = jax.ShapeDtypeStruct((9,), np.int32)
        hashes = tiny.engram_hashes(np.zeros(9, np.int32))
        jaxpr = jax.make_jaxpr(lambda s, i, h: forward(nnx.merge(graphdef, s), i, h))(state, ids, hashes)
    finally:
        set_kernel_impl(tiny.module, "auto")
    sites = expected_fused_sites(tiny.module.layers)
    assert sites > len(tiny.module.layers)  # both the FFN and the attention sites are fused
    assert pallas_calls(jaxpr, "mhc_post_pre") == (sites if impl == "pallas" else 0)


def _served(model, impl: str, prompt: list[int], decode: int) -> tuple[np.ndarray, Runner]:
    """Logits of the last row of each step: the prompt in one chunk, then greedy decode steps."""
    r = Runner(model, RuntimeConfig(**RC, kernel_impl=impl), progress=False)
    r.precompile(KEYS)
    d = Driver(r)
    d.start("a", prompt)
    out = [d.step({"a": len(prompt)})["a"]]
    for _ in range(decode):
        d.append("a", int(np.argmax(out[-1])))
        out.append(d.step({"a": 1})["a"])
    return np.stack(out), r


def test_runtime_logits_agree_across_impls_and_segments_hold_the_kernel(tiny):
    rng, msg = seeded_rng()
    prompt = [int(t) for t in rng.integers(3, 500, 13)]
    # "xla" (the CPU default: the same ops) is covered by tests/serving/test_runtime.py against Model.logits,
    # which test_model_logits_agree_across_impls ties to "reference".
    try:
        ref, _ = _served(tiny, "reference", prompt, decode=2)
        got, runner = _served(tiny, "pallas", prompt, decode=2)
    finally:
        set_kernel_impl(tiny.module, "auto")
    np.testing.assert_allclose(got, ref, **TOL, err_msg=msg)
    seg1, seg2 = runner.trace(("seg1", 16)), runner.trace(("seg2", 16))
    mhc_calls = pallas_calls(seg1, "mhc_post_pre") + pallas_calls(seg2, "mhc_post_pre")
    assert mhc_calls == expected_fused_sites(tiny.module.layers)  # the segments split the model's sites
    # One attention kernel per layer (the cut layer's in segment 2, reading the window rows of the whole step)
    # and one indexer scoring kernel per index source.
    assert pallas_calls(seg1, "sparse_mla") + pallas_calls(seg2, "sparse_mla") == len(tiny.module.layers)
    index_sources = sum(b.role.is_index_source for b in tiny.module.layers)
    assert index_sources > 0 and pallas_calls(seg1, "index_scores") + pallas_calls(seg2, "index_scores") == index_sources


def test_unknown_impl_refused(tiny):
    with pytest.raises(ValueError, match="impl must be one of"):
        set_kernel_impl(tiny.module, "cuda")
    with pytest.raises(ValueError, match="impl must be one of"):
        tiny.set_kernel_impl("cuda")
