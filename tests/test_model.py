"""Model-level invariants for the V4.1 parts no external oracle covers (spec §5.2 (i)): causality of every
component, CED sharing against own-source layers, two-level candidates, dtype and batching."""

import jax.numpy as jnp
import numpy as np
import pytest

import dsv41
from dsv41.config import ModelConfig

T = 40  # > window 8, > 3 candidate blocks x 2, odd lengths leave open ratio-2 groups


@pytest.fixture(scope="module")
def tiny():
    return dsv41.random_model("tiny", seed=1)


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(0).integers(3, 512, T)


def test_causal_every_prefix(tiny, ids):
    """Logits at p depend only on tokens <= p: compressor open groups, indexer masks, candidate blocks,
    Engram look-back and SWA windows must all be causal."""
    full = tiny.logits(ids)
    for t in (1, 9, 23):
        np.testing.assert_allclose(tiny.logits(ids[:t]), full[:t], atol=2e-5, rtol=0)
    changed = ids.copy()
    changed[20:] = (changed[20:] + 1) % 512
    np.testing.assert_allclose(tiny.logits(changed)[:20], full[:20], atol=2e-5, rtol=0)
    assert np.abs(tiny.logits(changed)[20:] - full[20:]).max() > 1e-3


def test_batch_equals_rows(tiny, ids):
    batch = np.stack([ids[:24], ids[5:29]])
    out = tiny.logits(batch)
    np.testing.assert_array_equal(out[1], tiny.logits(ids[5:29]))


def _no_engram(c: ModelConfig) -> ModelConfig:
    return c.replace(engram_layer_ids=(), engram_num_embeddings=())


def _params_without_engram(m):
    return {p: v for p, v in m.params.items() if not (p[0] == "layers" and p[2] == "engram")}


def test_ced_sharing_equals_own_source_when_sharing_is_trivial():
    """Layer 3 reads layer 2's global rows and top-k. Make layer 2 a no-op on the streams and keep all
    streams equal (then every layer sees the same normalized input), give layer 3 the attention
    projections of layer 2: a layer-3-owns-its-compressor config with layer 2's compressor/indexer
    weights must then give the same logits. The control (layer 2 not a no-op) must not."""
    shared_cfg = _no_engram(ModelConfig.preset("tiny"))
    own_cfg = shared_cfg.replace(kv_source_layer_ids=(2, 3, 4), index_source_layer_ids=(2, 3, 4, 6))
    base = dsv41.random_model(shared_cfg, seed=2)
    p = {k: np.asarray(v).copy() for k, v in base.params.items()}
    n = shared_cfg.hc_mult
    for k in p:
        if k[-1] == "fn" and k[-2] in ("hc_attn", "hc_ffn"):
            p[k][n:2 * n] = 0.0  # post mix independent of the streams ...
        if k[-1] == "base" and k[-2] in ("hc_attn", "hc_ffn"):
            p[k][n:2 * n] = p[k][n]  # ... and equal for all of them: streams stay equal
    p[("layers", 3, "attn_norm", "weight")] = p[("layers", 2, "attn_norm", "weight")]
    for name in ("wq_a", "q_norm", "wq_b", "wkv", "kv_norm"):
        p[("layers", 3, "attn", name, "weight")] = p[("layers", 2, "attn", name, "weight")]

    def run(noop: bool):
        q = dict(p)
        if noop:  # layer 2 writes nothing into the streams
            for k in [("layers", 2, "attn", "wo_b", "weight"), ("layers", 2, "ffn", "experts", "w2"),
                      ("layers", 2, "ffn", "shared_experts", "w2", "weight")]:
                q[k] = np.zeros_like(q[k])
        own = dict(q)
        for k in list(q):
            if k[:4] in (("layers", 2, "attn", "compressor"), ("layers", 2, "attn", "indexer")):
                own[("layers", 3) + k[2:]] = q[k]
        ids = np.random.default_rng(3).integers(3, 512, 29)
        a = dsv41.Model(shared_cfg, q).logits(ids)
        b = dsv41.Model(own_cfg, own).logits(ids)
        return np.abs(a - b).max()

    assert run(noop=True) < 1e-4
    assert run(noop=False) > 1e-2


def test_candidates_noop_below_topk_blocks_and_restrict_above(tiny):
    """Layer 6 restricts its top-k to layer 4's 3 blocks x 2 rows: identical to no candidate source while
    a query sees <= 3 blocks (<= 6 ratio-1 rows), different once it sees more."""
    no_cand = dsv41.Model(tiny.config.replace(candidate_source_layer_id=None), tiny.params)
    ids = np.random.default_rng(4).integers(3, 512, T)
    a, b = tiny.logits(ids), no_cand.logits(ids)
    np.testing.assert_array_equal(a[:6], b[:6])
    assert np.abs(a[6:] - b[6:]).max() > 1e-3


def test_bfloat16_tracks_float32(ids):
    """Same (bf16-representable) weights: bf16 activations stay close to float32 except where rounding
    flips a discrete choice (an expert or a top-k row) on some rows."""
    b16 = dsv41.random_model("tiny", seed=5, dtype="bfloat16")
    f32 = dsv41.Model(b16.config, {p: np.asarray(v, np.float32) if v.dtype == jnp.bfloat16 else v
                                   for p, v in b16.params.items()})
    lb, lf = b16.logits(ids), f32.logits(ids)
    assert np.corrcoef(lb.ravel(), lf.ravel())[0, 1] > 0.99
    assert np.median(np.abs(lb - lf)) < 0.05 * lf.std()


def test_fake_quant_perturbs_slightly(tiny, ids):
    plain, fq = tiny.logits(ids), tiny.logits(ids, fake_quant=True)
    assert 0 < np.abs(plain - fq).max() and np.corrcoef(plain.ravel(), fq.ravel())[0, 1] > 0.9


def test_bad_input_ids(tiny):
    for bad, msg in ((np.array([512]), "must lie in"), (np.zeros(0, np.int64), "empty"),
                     (np.array([[1.5]]), "integer")):
        with pytest.raises(ValueError, match=msg):
            tiny.logits(bad)


def test_compiled_forward_keeps_topk_custom_calls(tiny, ids):
    """XLA turns a sliced top-k into a full sort (jax-notes §6.3): the routers, indexers and candidate
    selection must compile to TopK. The only sorts allowed order the MoE's T*k (token, choice) pairs by
    expert for the grouped matmul - never a sort over scores or the vocabulary."""
    import re

    hlo = tiny.compiled_text(len(ids))
    pairs = len(ids) * tiny.config.num_experts_per_tok
    for shape, dim in re.findall(r"\[([\d,]+)\][^ ]* sort\(.*?dimensions=\{(\d+)\}", hlo):
        assert int(shape.split(",")[int(dim)]) == pairs, (shape, dim)
    assert len(re.findall(r"TopK", hlo, flags=re.IGNORECASE)) >= 8 + 3 + 1  # 8 routers, 3 indexers, candidates


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_output_projection_forms_agree(monkeypatch, dtype):
    """project_out's batched form (few rows, or a mesh) and its per-group GEMMs (many rows): the same bits in bfloat16;
    float32 sums the same products in another order (XLA:CPU's GEMMs), so they agree to rounding."""
    import dsv41.layers.attention as attention

    attn = dsv41.random_model("tiny", seed=2, dtype=dtype).module.layers[0].attn
    o = jnp.asarray(np.random.default_rng(3).standard_normal((12, attn.n_heads, attn.head_dim)), jnp.float32)
    outs = []
    for rows in (0, 64):  # 0: per-group GEMMs at any row count; 64: the batched form at 12 rows
        monkeypatch.setattr(attention, "GROUPED_BATCHED_MAX_ROWS", rows)
        outs.append(np.asarray(attn.project_out(o, attn.wo_b.matrix().dtype).astype(jnp.float32)))
    assert attn.o_groups > 1 and np.abs(outs[0]).max() > 0
    if dtype == "bfloat16":
        np.testing.assert_array_equal(outs[0], outs[1])
    else:
        np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows", [2, 64])  # the per-pair form; the batched form of a prefill
def test_moe_rows_outside_valid_get_the_shared_expert_only(tiny, rows):
    """`MoE.routed` with valid_T (a serving step's padding rows): the valid rows' outputs are the unmasked
    call's bit for bit, the others the shared expert's alone; the router's choices are returned for every row."""
    moe = tiny.module.layers[1].ffn
    x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, tiny.config.hidden_size)), tiny.dtype)
    ids = jnp.asarray(np.random.default_rng(1).integers(3, 512, rows), jnp.int32)
    valid = jnp.arange(rows) % 3 != 1 if rows > 2 else jnp.asarray([True, False])
    y, sel = moe.routed(x, ids)
    y_masked, sel_masked = moe.routed(x, ids, valid)
    np.testing.assert_array_equal(np.asarray(sel_masked), np.asarray(sel))
    v = np.asarray(valid)
    np.testing.assert_array_equal(np.asarray(y_masked)[v], np.asarray(y)[v])
    shared = np.asarray(moe.shared_experts(x).astype(x.dtype))
    np.testing.assert_array_equal(np.asarray(y_masked)[~v], shared[~v])
    assert np.abs(np.asarray(y)[~v] - shared[~v]).max() > 1e-3  # unmasked, the same rows route
