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
from dsv41.layers.basic import Linear, with_kernels
from dsv41.layers.moe import Experts, Router
from dsv41.model import forward
from pallas_kernels.kernel_config import KernelConfig
from serving.runtime.config import RuntimeConfig
from serving.runtime.programs import Program
from serving.runtime.runner import Runner
from tests.jaxpr_walk import equations
from tests.pallas_kernels.util import seeded_rng
from tests.serving.driver import Driver

TOL = dict(rtol=1e-4, atol=1e-4)
# A 13-row prefill in the 16-row bucket (window 8: decoder replay trims it to 8 rows after the cut) and
# decode steps in the 1-row bucket (the split-key decode form of the attention kernel).
RC = dict(max_num_seqs=1, max_num_batched_tokens=16, max_model_len=64, block_size=8, token_buckets=(1, 16))
KEYS = [seg.at(T) for seg in (Program.SEGMENT1, Program.SEGMENT2) for T in RC["token_buckets"]]


@pytest.fixture(scope="module")
def tiny():
    return dsv41.random_model("tiny", seed=3)


def pallas_calls(closed_jaxpr, name: str) -> int:
    """Number of pallas_calls of kernel `name` in a traced program, nested jaxprs included."""
    return sum(e.primitive.name == "pallas_call" and e.params.get("name") == name for e in equations(closed_jaxpr))


def expected_fused_sites(blocks) -> int:
    """V4.1: every FFN input, and every attention input after the first block unless Engram sits between."""
    return sum(1 + (i > 0 and b.engram is None) for i, b in enumerate(blocks))


def kernel_modules(module):
    return [m for _, m in nnx.iter_modules(module) if isinstance(m, (Router, Experts, Block, Linear))]


def test_model_logits_agree_across_impls(tiny):
    rng, msg = seeded_rng()
    ids = rng.integers(3, 500, 13).astype(np.int32)
    ref = tiny.with_kernels(KernelConfig(impl="reference")).logits(ids)
    for impl in ("xla", "pallas"):
        np.testing.assert_allclose(tiny.with_kernels(KernelConfig(impl=impl)).logits(ids), ref, **TOL,
                                   err_msg=f"{msg} {impl}")
    assert tiny.kernels == KernelConfig() and all(m.kernels == KernelConfig() for m in kernel_modules(tiny.module))
    built = dsv41.random_model("tiny", seed=3, kernels=KernelConfig(impl="reference"))  # the kernels given at build
    assert all(m.kernel_impl == "reference" for m in kernel_modules(built.module))
    np.testing.assert_array_equal(built.logits(ids), ref, err_msg=msg)


def test_with_kernels_is_a_new_model_over_the_same_arrays(tiny):
    """`Model.with_kernels` gives a new model whose forward is traced with the new kernels (the fused mHC kernel
    under "pallas"), over the very parameter arrays of the original, which keeps its graph and its kernels."""
    graph = nnx.split(tiny.module)[0]
    pallas = tiny.with_kernels(KernelConfig(impl="pallas"))
    assert pallas is not tiny and pallas.module is not tiny.module and pallas.kernels == KernelConfig(impl="pallas")
    assert all(m.kernel_impl == "pallas" for m in kernel_modules(pallas.module))
    assert nnx.split(tiny.module)[0] == graph and all(m.kernel_impl == "auto" for m in kernel_modules(tiny.module))
    new_state, old_state = (nnx.to_flat_state(nnx.split(m.module)[1]) for m in (pallas, tiny))
    assert len(new_state) == len(old_state) == len(tiny.params)
    assert all(p == q and a.get_value() is b.get_value() for (p, a), (q, b) in zip(new_state, old_state))  # no copy
    assert all(a is b for a, b in zip(pallas._leaves, tiny._leaves))
    ids = jax.ShapeDtypeStruct((9,), np.int32)
    hashes = tiny.engram_hashes(np.zeros(9, np.int32))
    traced = {name: jax.make_jaxpr(lambda lv, i, h: m._fn(lv, i, h, fake_quant=False))(m._leaves, ids, hashes)  # noqa: B023
              for name, m in (("pallas", pallas), ("auto", tiny))}
    assert pallas_calls(traced["pallas"], "mhc_post_pre") == expected_fused_sites(tiny.module.layers)
    assert pallas_calls(traced["auto"], "mhc_post_pre") == 0


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas"])
def test_fused_mhc_only_under_pallas(tiny, impl):
    graphdef, state = nnx.split(tiny.with_kernels(KernelConfig(impl=impl)).module)
    ids = jax.ShapeDtypeStruct((9,), np.int32)
    hashes = tiny.engram_hashes(np.zeros(9, np.int32))
    jaxpr = jax.make_jaxpr(lambda s, i, h: forward(nnx.merge(graphdef, s), i, h))(state, ids, hashes)
    sites = expected_fused_sites(tiny.module.layers)
    assert sites > len(tiny.module.layers)  # both the FFN and the attention sites are fused
    assert pallas_calls(jaxpr, "mhc_post_pre") == (sites if impl == "pallas" else 0)


def _served(model, impl: str, prompt: list[int], decode: int) -> tuple[np.ndarray, Runner]:
    """Logits of the last row of each step: the prompt in one chunk, then greedy decode steps."""
    r = Runner(model, RuntimeConfig(**RC, kernel_impl=impl), progress=False)
    r.compiler.precompile(KEYS)
    d = Driver(r)
    d.start("a", prompt)
    out = [d.step({"a": len(prompt)})["a"]]
    for _ in range(decode):
        d.append("a", int(np.argmax(out[-1])))
        out.append(d.step({"a": 1})["a"])
    return np.stack(out), r


@pytest.mark.slow
def test_runtime_logits_agree_across_impls_and_segments_hold_the_kernel(tiny):
    rng, msg = seeded_rng()
    prompt = [int(t) for t in rng.integers(3, 500, 13)]
    # "xla" (the CPU default: the same ops) is covered by tests/serving/test_runtime.py against Model.logits,
    # which test_model_logits_agree_across_impls ties to "reference".
    ref, _ = _served(tiny, "reference", prompt, decode=2)
    got, runner = _served(tiny, "pallas", prompt, decode=2)
    np.testing.assert_allclose(got, ref, **TOL, err_msg=msg)
    assert runner.compiler.kernels == KernelConfig(impl="pallas", moe_small_step_form="rule")
    assert all(m.kernel_impl == "auto" for m in kernel_modules(tiny.module))  # the runner left the model as it was
    seg1, seg2 = runner.compiler.trace(Program.SEGMENT1.at(16)), runner.compiler.trace(Program.SEGMENT2.at(16))
    mhc_calls = pallas_calls(seg1, "mhc_post_pre") + pallas_calls(seg2, "mhc_post_pre")
    assert mhc_calls == expected_fused_sites(tiny.module.layers)  # the segments split the model's sites
    # One attention kernel per layer (the cut layer's in segment 2, reading the window rows of the whole step)
    # and one indexer scoring kernel per index source.
    assert pallas_calls(seg1, "sparse_mla") + pallas_calls(seg2, "sparse_mla") == len(tiny.module.layers)
    index_sources = sum(b.role.is_index_source for b in tiny.module.layers)
    assert index_sources > 0 and pallas_calls(seg1, "index_scores") + pallas_calls(seg2, "index_scores") == index_sources


def test_unknown_impl_refused(tiny):
    with pytest.raises(ValueError, match="impl must be one of"):
        KernelConfig(impl="cuda")
    with pytest.raises(TypeError, match="kernels must be a KernelConfig"):
        with_kernels(tiny.module, "xla")
    with pytest.raises(TypeError, match="kernels must be a KernelConfig"):
        tiny.with_kernels("xla")
