"""Engram: the prime layout and table sizes of the release, hashing against the spec's pseudo-code, the
compressed-token map, and the gated write."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv41.config import ModelConfig
from dsv41.layers.engram import (Engram, EngramLayout, build_compressed_token_map, engram_primes, hash_multipliers,
                                 ngram_windows)


def test_full_config_table_sizes_and_primes():
    c = ModelConfig.preset("v41-flash")
    primes = engram_primes(2, c.engram_max_ngram_size, c.engram_n_heads, c.engram_vocab_size)
    assert [sum(p) for p in primes] == [384006168, 384016682]  # spec §1.1 engram_num_embeddings
    assert primes[0][:2] == (16000057, 16000079) and primes[1][0] == 16000477  # spec §2.10
    flat = [p for layer in primes for p in layer]
    assert len(set(flat)) == len(flat) == 48  # never reused across layers


def test_multipliers_match_spec():
    m = hash_multipliers((1, 14), 4, 99092)
    assert m[0].tolist() == [76632096046245, 4839876093313, 35959672319349, 73987337458391]
    assert m[1].tolist() == [67716810739261, 51510806800915, 30921347202721, 82619226485591]


def _spec_hash(ids, token_map, layout, li, p):
    """Spec §2.10 pseudo-code, literally, with Python integers."""
    pad_c, rolling, blocked, out = int(token_map[layout.pad_token_id]), 0, False, []
    for s in range(layout.max_ngram):
        blocked = blocked or p - s < 0
        v = pad_c if blocked else int(token_map[ids[p - s]])
        rolling ^= v * int(layout.multipliers[li, s])
        if s >= 1:
            for h in range(layout.n_heads):
                col = (s - 1) * layout.n_heads + h
                out.append(rolling % int(layout.primes[li, col]) + int(layout.offsets[li, col]))
    return out


def test_hash_ids_match_spec_pseudocode_with_real_layer_ids():
    c = ModelConfig.preset("v41-flash")
    layout = EngramLayout.from_config(c)
    rng = np.random.default_rng(0)
    token_map = rng.integers(0, c.engram_compressed_vocab_size, c.vocab_size)
    ids = rng.integers(0, c.vocab_size, 12)
    got = layout.hash_ids(ids, token_map)
    assert got.shape == (12, 2, 24) and got.dtype == np.int32
    for p in range(12):
        for li in range(2):
            assert got[p, li].tolist() == _spec_hash(ids, token_map, layout, li, p)
    assert np.all(got < layout.rows[None, :, None]) and np.all(got >= 0)
    # Hashing a suffix (start > 0) uses the same look-back as the full sequence.
    np.testing.assert_array_equal(layout.hash_ids(ids, token_map, start=5), got[5:])


@pytest.mark.parametrize("preset", ["v41-flash", "tiny"])
def test_device_hash_of_a_pending_token_matches_the_host_hash(preset):
    """Async scheduling: the host's look-back and the device's finish (32-bit, jitted) give `hash_ids` of the row
    whose token the host has not seen, at every position from 0 (look-back into the padding) on. The full-size
    layout's 24-bit primes and 46-bit multipliers exercise every digit of the uint32 reduction."""
    c = ModelConfig.preset(preset)
    layout = EngramLayout.from_config(c)
    rng = np.random.default_rng(1)
    token_map = rng.integers(0, c.engram_compressed_vocab_size, c.vocab_size)
    terms = layout.token_terms(token_map)
    ids = rng.integers(0, c.vocab_size, 10)
    want = layout.hash_ids(ids, token_map)
    look = layout.look_back(ngram_windows(ids, 0, c.engram_max_ngram_size)[:, 1:], token_map)
    got = jax.jit(layout.device_hash_ids)(terms[ids], look)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_compressed_token_map(tmp_path):
    vocab = {"<pad>": 0, "The": 1, "the": 2, "THE": 3, "é": 4, "e": 5, " ": 6, "  ": 7, "\n": 8, "x y": 9, "x\t y": 10}
    tok = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
           "pre_tokenizer": None, "post_processor": None, "decoder": None,
           "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<pad>"}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    m, size = build_compressed_token_map(tmp_path / "tokenizer.json", vocab_size=13, pad_token_id=2)
    assert m[1] == m[2] == m[3] and m[4] == m[5] and m[6] == m[7] == m[8] and m[9] == m[10]
    assert m[0] == 0 and m[1] == 1 and len({m[0], m[1], m[4], m[6], m[9]}) == 5 and size == 5
    assert m[11] == m[12] == m[2]  # ids past the tokenizer map to the entry of id 2 (the pad id)


def test_gated_write_matches_formula():
    D, n, hd, cols = 16, 4, 32, 6
    eng = Engram(rows=50, n_cols=cols, head_dim=hd, hc_mult=n, dim=D, eps=1e-6, table_fp8=True, dtype=jnp.float32)
    rng = np.random.default_rng(1)
    table = rng.standard_normal((50, hd)).astype(np.float32)
    from dsv41.quant import dequantize_fp8_blocks, quantize_fp8_blocks

    q, s = quantize_fp8_blocks(table, (1, 32))
    params = {"embed": {"weight": q, "scale": s},
              "wkv": {"weight": rng.standard_normal(((n + 1) * D, cols * hd)) * 0.05},
              "q_weight": 1 + 0.1 * rng.standard_normal((n, D)), "k_weight": 1 + 0.1 * rng.standard_normal((n, D))}
    nnx.update(eng, nnx.State({"embed": {"weight": jnp.asarray(q), "scale": jnp.asarray(s)},
                               "wkv": {"weight": jnp.asarray(params["wkv"]["weight"], jnp.float32)},
                               "q_weight": jnp.asarray(params["q_weight"], jnp.float32),
                               "k_weight": jnp.asarray(params["k_weight"], jnp.float32)}))
    R = rng.standard_normal((3, n, D)).astype(np.float32)
    ids = rng.integers(0, 50, (3, cols))
    got = np.asarray(eng(jnp.asarray(R), jnp.asarray(ids)))
    rows = dequantize_fp8_blocks(q, s, (1, 32))[ids].reshape(3, -1).astype(np.float64)
    kv = (rows @ params["wkv"]["weight"].T).reshape(3, n + 1, D)
    for t in range(3):
        for i in range(n):
            h, k, v = R[t, i].astype(np.float64), kv[t, i], kv[t, n]
            dot = np.sum(h * params["q_weight"][i] * params["k_weight"][i] * k)
            dot /= np.sqrt(np.mean(h * h) + 1e-6) * np.sqrt(np.mean(k * k) + 1e-6) * np.sqrt(D)
            g = 1 / (1 + np.exp(-np.sign(dot) * np.sqrt(max(abs(dot), 1e-6))))
            np.testing.assert_allclose(got[t, i], h + g * v, rtol=2e-5, atol=2e-5)
