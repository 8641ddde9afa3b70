"""Routed-expert grouped matmul: the XLA path's three forms (batched with its tile tail, tiles, per pair) and Pallas
(interpret) against the dense reference on awkward routings, MXFP4 / FP8 weights decoded in the kernel against the
reference on the checkpoint decoder's weights, the reference against the model's `Experts`, the XLA path's
compiled HLO (no large sort, no ragged dot; the batched form's weights read in place) and both Triton kernels
lowered for CUDA at V4.1-Flash sizes."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv41 import quant
from pallas_kernels import lowering, moe_gmm, moe_xla
from pallas_kernels.expert_weights import QuantizedExperts, quantized_experts, reference_dequantize
from tests.pallas_kernels.util import assert_close, seeded_rng

T, D, I, E = 11, 64, 96, 8  # T not a multiple of any tile; I = 3 x 32 (like 2304 = 9 x 256)
LIMIT = 1.0  # small enough that the SwiGLU clamps bite


def float_weights(rng):
    f = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[-1]) * 2, jnp.float32)
    return f(E, I, D), f(E, I, D), f(E, D, I)


def routing(rng, kind: str):
    """ids [T, 3], weights [T, 3] for the named routing."""
    k = 3
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    w = rng.uniform(0.1, 1.0, (T, k)).astype(np.float32)
    if kind == "random":  # experts left empty, and padding slots (-1, E) that contribute nothing
        ids = np.where(ids >= E - 2, 1, ids)
        ids[2, 1], ids[5, 0] = -1, E
    elif kind == "one_expert_all_tokens":  # every token in expert 3; the other slots in experts 0-1 only
        ids[:, 0] = 3
        ids[:, 1:] = rng.integers(0, 2, (T, k - 1))
    elif kind == "duplicates":  # the same expert twice in a token, and equal weights
        ids[:, 1] = ids[:, 0]
        w[:, 1] = w[:, 0]
        w[::2, 2] = w[::2, 0]
    return jnp.asarray(ids), jnp.asarray(w)


@pytest.mark.parametrize("kind", ["random", "one_expert_all_tokens", "duplicates"])
def test_xla_and_pallas_match_reference(kind):
    rng, msg = seeded_rng()
    ids, w = routing(rng, kind)
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    w1, w3, w2 = float_weights(rng)
    want = moe_gmm.reference(x, ids, w, w1, w3, w2, limit=LIMIT)
    tiles = moe_xla.xla(x, ids, w, w1, w3, w2, limit=LIMIT, tile=4)
    assert_close(tiles, want, f"{msg} xla tile 4")
    # the batched form: capacity 2 leaves rows of the fuller experts to its tail (11 in expert 3 when one expert
    # has every token), 16 and 40 hold them all (40: the weights on the right of the products, the others on the
    # left); without a form named, a step this small takes the per-pair form
    for capacity in (2, 16, 40):
        got = moe_xla.xla(x, ids, w, w1, w3, w2, limit=LIMIT, capacity=capacity)
        assert_close(got, want, f"{msg} xla capacity {capacity}")
        assert_close(got, tiles, f"{msg} xla capacity {capacity} vs tiles", rtol=1e-6, atol=1e-6)
    assert_close(moe_xla.xla(x, ids, w, w1, w3, w2, limit=LIMIT), want, f"{msg} xla per pair")
    got = moe_gmm.routed_experts(x, ids, w, w1, w3, w2, limit=LIMIT, impl="pallas")
    assert_close(got, want, f"{msg} pallas", rtol=2e-5, atol=2e-5)
    if kind == "random":  # the -1 / E slots really contribute nothing
        keep = (ids >= 0) & (ids < E)
        alone = moe_gmm.reference(x, jnp.where(keep, ids, 0), jnp.where(keep, w, 0.0), w1, w3, w2, limit=LIMIT)
        assert_close(want, alone, msg + " dropped slots")
        # experts renumbered so the last one (where the batched form parks dropped pairs) holds rows
        flip = jnp.where(keep, E - 1 - ids, ids)
        want = moe_gmm.reference(x, flip, w, w1, w3, w2, limit=LIMIT)
        for capacity in (2, 16, 40):
            got = moe_xla.xla(x, flip, w, w1, w3, w2, limit=LIMIT, capacity=capacity)
            assert_close(got, want, f"{msg} dropped slots, xla capacity {capacity}")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_per_pair_form_skips_trailing_rows_without_routed_pairs(dtype):
    """A decode step's padding rows come with every id dropped (`MoE.routed`'s valid_T): the per-pair form
    computes the rows up to the last live one, rounded up to a power of two, only - the live rows' bits those rows
    give alone, exact zeros for the dropped ones, even where their x is NaN when they are skipped (a weight-0
    product would spread it) - and a dropped row between live ones weighs 0 as before."""
    rng, msg = seeded_rng()
    k = 3
    w1, w3, w2 = (a.astype(dtype) for a in float_weights(rng))
    x = jnp.asarray(rng.standard_normal((4, D)), dtype)
    ids = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(4)]), jnp.int32)
    w = jnp.asarray(rng.uniform(0.1, 1.0, (4, k)), jnp.float32)
    per_pair = jax.jit(lambda x, ids, w: moe_xla.xla(x, ids, w, w1, w3, w2, limit=LIMIT))
    assert 4 * k * 3 * I * D * 4 <= moe_xla.GATHER_BYTES  # the per-pair form
    for live in (1, 2, 3):
        dead = jnp.arange(4)[:, None] >= live
        skipped = dead & (live in (1, 2))  # 3 live rows run as 4
        got = per_pair(jnp.where(skipped, jnp.nan, x).astype(dtype), jnp.where(dead, -1, ids), w)
        alone = per_pair(x[:live], ids[:live], w[:live])
        np.testing.assert_array_equal(np.asarray(got[:live]), np.asarray(alone), f"{msg} {live} live rows")
        assert not np.asarray(got[live:]).any(), f"{msg}: dropped rows after {live} live ones"
    middle = jnp.asarray([[True], [False], [True], [False]])
    got = per_pair(x, jnp.where(middle, ids, -1), w)
    want = moe_gmm.reference(x, jnp.where(middle, ids, -1), w, w1, w3, w2, limit=LIMIT)
    assert_close(got, want, f"{msg} a dropped row between live ones", rtol=2e-2 if dtype == jnp.bfloat16 else 1e-5,
                 atol=2e-2 if dtype == jnp.bfloat16 else 1e-5)
    assert not np.asarray(got[1::2]).any()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("kind", ["random", "one_expert_all_tokens", "duplicates"])
def test_small_step_forms_agree(dtype, kind, monkeypatch):
    """A step of few rows per expert in each of SMALL_STEP_FORMS (what the tuner picks between; one expert holding
    every token: the batched forms' tail runs): the reference's values; tiles give the rule's (weights right) bits,
    the weights-left products its values to float32 rounding (the same bits on an AMX Xeon, 1 ulp apart on an
    AVX512-BF16 EPYC); an unknown form is refused by name."""
    monkeypatch.setattr(moe_xla, "GATHER_BYTES", 0)  # not the per-pair form
    rng, msg = seeded_rng()
    ids, w = routing(rng, kind)
    assert moe_xla.batch_capacity(ids.size, E) <= moe_xla.SMALL_STEP_MAX_ROWS  # a small step
    x = jnp.asarray(rng.standard_normal((T, D)), dtype)
    w1, w3, w2 = (a.astype(dtype) for a in float_weights(rng))
    rule = moe_xla.xla(x, ids, w, w1, w3, w2, limit=LIMIT)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == jnp.bfloat16 else {}
    assert_close(rule, moe_gmm.reference(x, ids, w, w1, w3, w2, limit=LIMIT), msg, **tol)
    assert moe_xla.SMALL_STEP_FORMS == ("batched_left", "batched_right", "tiles")
    right, tiles = (moe_xla.xla(x, ids, w, w1, w3, w2, limit=LIMIT, small_steps=f) for f in ("batched_right", "tiles"))
    np.testing.assert_array_equal(np.asarray(right), np.asarray(rule), msg)
    np.testing.assert_array_equal(np.asarray(tiles), np.asarray(rule), f"{msg} tiles")
    left = moe_xla.xla(x, ids, w, w1, w3, w2, limit=LIMIT, small_steps="batched_left")
    assert_close(left, rule, f"{msg} batched_left", rtol=1e-5, atol=1e-6)
    for unknown in ("fastest", "tune"):  # choosing ("tune") is the caller's, not the kernel's
        with pytest.raises(ValueError, match="small_steps must be one of"):
            moe_xla.xla(x, ids, w, w1, w3, w2, limit=LIMIT, small_steps=unknown)


def test_experts_compile_the_small_step_form_of_their_kernel_config(monkeypatch):
    """A model's `Experts` compiles the XLA path's program of the form its `KernelConfig` gives its call's shape - the
    form listed for that step, else `moe_small_step_form` - (a small step: the per-pair form ruled out), and a
    `KernelConfig` refuses unknown forms by field name."""
    from dsv41.layers.basic import with_kernels
    from dsv41.layers.moe import Experts
    from pallas_kernels.kernel_config import KernelConfig, MoeStep

    monkeypatch.setattr(moe_xla, "GATHER_BYTES", 0)
    rng, _ = seeded_rng()
    ids, w = routing(rng, "random")
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    m = Experts(E, D, I, LIMIT, dtype=jnp.float32)
    step = MoeStep(T, 3, E, I, D, "float32")
    assert m.small_step(T, 3) == step and moe_xla.is_small_step(T * 3, E, I, D)
    lower = lambda f: jax.jit(f).lower(x, ids, w).as_text()  # noqa: E731
    direct = {form: lower(lambda *a: moe_xla.xla(*a, *m.weights(), limit=LIMIT, small_steps=form))  # noqa: B023
              for form in moe_xla.SMALL_STEP_FORMS}
    assert len(set(direct.values())) == len(direct)  # three distinct programs
    for form in moe_xla.SMALL_STEP_FORMS:
        other = next(f for f in moe_xla.SMALL_STEP_FORMS if f != form)
        for kernels in (KernelConfig(impl="xla", moe_small_step_form=form),
                        KernelConfig(impl="xla", moe_small_step_form=other, moe_small_steps={step: form}),
                        KernelConfig(impl="xla", moe_small_steps=((step._replace(rows=T + 1), other), (step, form)))):
            held = with_kernels(m, kernels)
            assert lower(lambda *a: held(*a)) == direct[form], (form, kernels)  # noqa: B023
    assert m.kernels == KernelConfig()  # with_kernels left it as it was
    with pytest.raises(ValueError, match="moe_small_step_form must be one of"):
        KernelConfig(moe_small_step_form="tune")
    with pytest.raises(ValueError, match="moe_small_steps: the form of"):
        KernelConfig(moe_small_steps={step: "rule"})
    with pytest.raises(ValueError, match="impl must be one of"):
        KernelConfig(impl="cuda")


@pytest.mark.parametrize("tile", [1, 4, 16])
def test_group_layout_places_every_pair_in_a_tile_of_its_expert(tile):
    rng, msg = seeded_rng()
    ids = rng.integers(-1, E + 1, (T, 3)).astype(np.int32)  # -1 and E: dropped
    ids[:4] = 2  # a crowded expert next to empty ones
    lay = jax.tree.map(np.asarray, moe_xla.group_layout(jnp.asarray(ids), E, tile))
    flat = ids.reshape(-1)
    P, Np = flat.size, lay.row_pair.size
    assert Np == moe_xla.padded_rows(P, E, tile) and Np % tile == 0, msg
    counts = np.bincount(flat[(flat >= 0) & (flat < E)], minlength=E)
    n_rows = int(np.sum(-(-counts // tile) * tile))
    assert lay.n_tiles[0] * tile == n_rows <= Np, msg
    for p in range(P):
        if 0 <= flat[p] < E:
            r = lay.pair_row[p]
            assert r < n_rows and lay.row_pair[r] == p and lay.tile_expert[r // tile] == flat[p], f"{msg} pair {p}"
        else:
            assert lay.pair_row[p] == Np, f"{msg} pair {p}"
    assert np.sum(lay.row_pair < P) == counts.sum(), msg  # every other row is padding


def _quantize(kind: str, w_EOI: np.ndarray) -> QuantizedExperts:
    """The checkpoint encoders, expert by expert (MXFP4: I8 + UE8M0 per 32; FP8: e4m3 + UE8M0 per 32 x 32)."""
    if kind == "mxfp4":
        parts = [quant.quantize_mxfp4(w) for w in w_EOI]
    else:
        parts = [quant.quantize_fp8_blocks(w, (32, 32)) for w in w_EOI]
    return quantized_experts(kind, jnp.asarray(np.stack([p[0] for p in parts])),
                             jnp.asarray(np.stack([p[1] for p in parts])))


def _checkpoint_decode(q: QuantizedExperts) -> jnp.ndarray:
    v, s = np.asarray(q.values), np.asarray(q.scales)
    if q.kind == "mxfp4":
        return jnp.asarray(np.stack([quant.dequantize_mxfp4(a.view(np.int8), b) for a, b in zip(v, s)]))
    return jnp.asarray(np.stack([quant.dequantize_fp8_blocks(a.view(ml_dtypes.float8_e4m3fn), b, (32, 32))
                                 for a, b in zip(v, s)]))


@pytest.mark.parametrize("kind,dtype", [("mxfp4", jnp.float32), ("fp8", jnp.float32), ("mxfp4", jnp.bfloat16)])
def test_quantized_weights_decoded_in_kernel(kind, dtype):
    rng, msg = seeded_rng()
    msg = f"{msg} {kind} {jnp.dtype(dtype).name}"
    ids, w = routing(rng, "random")
    x = jnp.asarray(rng.standard_normal((T, D)), dtype)
    # magnitudes varying by 2**-3..2**3 per 32 x 32 block, so neighbouring blocks get different scales
    factor = lambda E_, O, In: np.repeat(np.repeat(2.0 ** rng.integers(-3, 4, (E_, O // 32, In // 32)), 32, 1), 32, 2)
    qs = [_quantize(kind, np.asarray(a) * factor(*a.shape) / 4) for a in float_weights(rng)]
    assert all(len(np.unique(np.asarray(q.scales))) > 3 for q in qs), msg
    deq = [_checkpoint_decode(q) for q in qs]
    for q, d in zip(qs, deq):
        assert_close(reference_dequantize(q), d, msg + " reference decode", rtol=0, atol=0)
    if dtype == jnp.float32:
        want = moe_gmm.reference(x, ids, w, *deq, limit=LIMIT)
        tol = dict(rtol=2e-5, atol=2e-5)
    else:  # bf16 activations: same rounding points as the reference, different summation order
        want = moe_gmm.reference(x, ids, w, *qs, limit=LIMIT)
        tol = dict(rtol=5e-3, atol=5e-3)  # (measured <= 3e-7: a bf16 flip of h would cost ~1e-3)
    assert_close(moe_gmm.pallas(x, ids, w, *qs, limit=LIMIT, interpret=True), want, msg + " pallas", **tol)
    assert_close(moe_xla.xla(x, ids, w, *qs, limit=LIMIT), want, msg + " xla", **tol)


def test_reference_and_model_experts_agree_with_every_expert_dense():
    """The oracle: every expert evaluated on every token, combined by a [T, E] matrix zero off the chosen
    experts (the model's swiglu with its clamp); the model's `Experts` (which now calls the dispatch) too."""
    from dsv41.layers.moe import Experts, swiglu

    rng, msg = seeded_rng()
    ids, w = routing(rng, "duplicates")
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    w1, w3, w2 = float_weights(rng)
    combine_TE = jnp.sum(jax.nn.one_hot(ids, E, dtype=jnp.float32) * w[..., None], axis=1)
    hp = jax.lax.Precision.HIGHEST
    gate = jnp.einsum("td,eid->tei", x, w1, precision=hp)
    up = jnp.einsum("td,eid->tei", x, w3, precision=hp)
    dense = jnp.einsum("tei,edi->td", swiglu(gate, up, LIMIT) * combine_TE[..., None], w2, precision=hp)
    assert_close(moe_gmm.reference(x, ids, w, w1, w3, w2, limit=LIMIT), dense, msg)
    m = Experts(E, D, I, LIMIT, dtype=jnp.float32)
    m.w1[...], m.w3[...], m.w2[...] = w1, w3, w2
    assert_close(m(x, ids, w), dense, msg + " model Experts")


def test_xla_hlo_has_no_large_sort_and_no_ragged_dot():
    """T*k = 10 pairs over E = 16 experts: the only sort is the argsort of the 10 pair keys, and every dot
    is one step's row tiles times one expert each (XLA:CPU lowers ragged_dot to a dot over all experts' rows)."""
    rng, _ = seeded_rng()
    Tq, k, Eq, tile = 5, 2, 16, 8
    f = lambda *s: jnp.zeros(s, jnp.float32)
    args = (f(Tq, D), jnp.asarray(rng.integers(0, Eq, (Tq, k)), jnp.int32), f(Tq, k), f(Eq, I, D), f(Eq, I, D),
            f(Eq, D, I))
    fn = jax.jit(lambda *a: moe_xla.xla(*a, limit=LIMIT, tile=tile))
    assert "ragged_dot" not in str(jax.make_jaxpr(fn)(*args))
    hlo = fn.lower(*args).compile().as_text()
    ops = lambda name: [ln.split(f" {name}(")[0] for ln in hlo.splitlines() if re.search(rf"\s{name}\(", ln)]
    sizes = lambda head: [int(n) for dims in re.findall(r"\[([\d,]+)\]", head) for n in dims.split(",")]
    assert ops("sort"), "expected the pair argsort"
    for head in ops("sort"):
        assert max(sizes(head)) <= Tq * k, head
    assert ops("dot")
    for head in ops("dot"):
        assert np.prod(sizes(head)) <= moe_xla.TILES_PER_STEP * tile * max(D, I), head


@pytest.mark.parametrize("Eq,C,left", [(8, 48, False), (32, 16, True)])
def test_xla_batched_form_reads_the_weights_in_place(Eq, C, left):
    """Float weights of a step too large for the per-pair form take the batched form: its three dots read the
    [E, I, D] / [E, D, I] weights as they are (no gathered copy), x as [E, capacity, D], the weights on the left
    of the products (outputs [E, I | D, C]) in a small step's "batched_left" form; the one sort is the pair
    argsort; the tail's tile loop (an unbalanced routing) runs inside a conditional."""
    Tq, k = 64, 4
    dt = jnp.bfloat16 if left else jnp.float32
    f = lambda *s: jnp.zeros(s, dt)
    args = (f(Tq, D), jnp.zeros((Tq, k), jnp.int32), f(Tq, k), f(Eq, I, D), f(Eq, I, D), f(Eq, D, I))
    assert Tq * k * 3 * I * D * 4 > moe_xla.GATHER_BYTES
    assert moe_xla.batch_capacity(Tq * k, Eq) == C  # 1.5 x the mean rows
    assert (C <= moe_xla.SMALL_STEP_MAX_ROWS) == left
    form = "batched_left" if left else "rule"
    hlo = jax.jit(lambda *a: moe_xla.xla(*a, limit=LIMIT, small_steps=form)).lower(*args).compile().as_text()
    dots = [ln for ln in hlo.splitlines() if re.search(r"\sdot\(", ln)]
    shapes = [f"f32[{Eq},{I},{C}]", f"f32[{Eq},{D},{C}]"] if left else [f"f32[{Eq},{C},{I}]", f"f32[{Eq},{C},{D}]"]
    batched = [ln for ln in dots if any(s in ln.split("=")[1].split("dot(")[0] for s in shapes)]
    assert len(batched) == 3, "\n".join(dots)
    weight_copy = rf"(f32|bf16)\[{Eq},({I},{D}|{D},{I})\].* (gather|copy|fusion)\("
    copies = [ln for ln in hlo.splitlines() if re.search(weight_copy, ln)]
    assert not copies, copies  # the weights are operands as they are, not gathered per expert
    assert "conditional(" in hlo
    sorts = [ln for ln in hlo.splitlines() if re.search(r"\ssort\(", ln)]
    assert sorts and all(f"[{Tq * k}]" in ln for ln in sorts), sorts


def test_bad_inputs_named():
    x, ids, w = jnp.zeros((4, D)), jnp.zeros((4, 2), jnp.int32), jnp.zeros((4, 2))
    w13 = jnp.zeros((E, I, D))
    with pytest.raises(ValueError, match="w2: expected float weights"):
        moe_gmm.routed_experts(x, ids, w, w13, w13, jnp.zeros((E, I, D)), limit=1.0, impl="xla")
    with pytest.raises(ValueError, match="ids_TK"):
        moe_gmm.routed_experts(x, w, w, w13, w13, jnp.zeros((E, D, I)), limit=1.0, impl="xla")
    bad = quantized_experts("mxfp4", jnp.zeros((E, I, D // 2), jnp.int8), jnp.zeros((E, I, D // 16), jnp.uint8))
    with pytest.raises(ValueError, match="w1: mxfp4 scales"):
        moe_gmm.routed_experts(x, ids, w, bad, bad, jnp.zeros((E, D, I)), limit=1.0, impl="reference")


@pytest.mark.parametrize("kind,fp8_block,T_rows", [("mxfp4", 0, 8), ("mxfp4", 0, 4096), ("fp8", 32, 64), ("fp8", 128, 8)])
def test_lowers_for_cuda_at_v41_flash_sizes(kind, fp8_block, T_rows):
    """Both Triton kernels at D, I, E, top-k of the v41-flash preset: MXFP4 weights, or FP8 with 32 x 32
    (V4.1 linears) / 128 x 128 (V4 linears, larger than the default weight tile) scale blocks."""
    from dsv41.config import ModelConfig

    c = ModelConfig.preset("v41-flash")
    Dm, Im, Em, k = c.hidden_size, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok
    S = jax.ShapeDtypeStruct
    u8 = lambda *s: S(s, jnp.uint8)
    if kind == "mxfp4":
        w13 = QuantizedExperts(u8(Em, Im, Dm // 2), u8(Em, Im, Dm // 32), kind)
        w2 = QuantizedExperts(u8(Em, Dm, Im // 2), u8(Em, Dm, Im // 32), kind)
    else:
        b = fp8_block
        w13 = QuantizedExperts(u8(Em, Im, Dm), u8(Em, Im // b, Dm // b), kind)
        w2 = QuantizedExperts(u8(Em, Dm, Im), u8(Em, Dm // b, Im // b), kind)
    text = lowering.lower_for_cuda(moe_gmm.pallas, S((T_rows, Dm), jnp.bfloat16), S((T_rows, k), jnp.int32),
                                   S((T_rows, k), jnp.float32), w13, w13, w2, limit=c.swiglu_limit, interpret=False)
    assert lowering.count_gpu_kernels(text) == 2
