"""Deterministic random weights in the DeepSeek *release* layout (numpy only).

``random_release_weights(config, seed)`` returns float32 tensors (int32 for
``ffn.gate.tid2eid``) keyed by the release tensor names (no ``model.`` prefix,
e.g. ``layers.0.attn.wq_a.weight``) for a parsed release ``config.json``:

* V4   (``model_type: deepseek_v4``, flat; ``compress_ratios`` in {0, 4, 128},
  ``num_hash_layers``), including ``compressor.ape``, the indexer's own
  compressor, ``hc_head_*`` and ``ffn.gate.tid2eid`` on hash-routed layers;
* V4.1 (``model_type: deepseek_v41``, text part under ``text_config``;
  ``compress_ratios`` in {0, 1, 2}, ``kv_source_layer_ids``,
  ``index_source_layer_ids``).

Engram and DSpark/MTP tensors are not generated (ValueError if requested).

Every parameter that real initialisers set to a constant (norm weights, sinks,
mHC base/scale, router bias, ``ape``) is randomised so that a wrong mapping or
a skipped term changes the logits. Tensors are drawn from one
``np.random.default_rng(seed)`` in sorted-name order, so the result depends
only on (config, seed).

This module must stay free of torch/jax/project imports: it is shared by the
torch oracle (``make_fixtures.py``) and the JAX tests.
"""

from __future__ import annotations

import numpy as np

__all__ = ["model_variant", "text_config", "release_tensor_specs", "random_release_weights", "weights_digest"]

V4_RATIOS = (0, 4, 128)
V41_RATIOS = (0, 1, 2)


def model_variant(config: dict) -> str:
    """'v4' or 'v41' from the root ``model_type``."""
    mt = config.get("model_type")
    if mt == "deepseek_v4":
        return "v4"
    if mt == "deepseek_v41" or (mt is None and config.get("text_config", {}).get("model_type") == "deepseek_v41_text"):
        return "v41"
    raise ValueError(f"unsupported model_type {mt!r} (expected 'deepseek_v4' or 'deepseek_v41')")


def text_config(config: dict) -> dict:
    """The language-model part of a release config (V4.1 nests it under ``text_config``)."""
    return config["text_config"] if "text_config" in config else config


def _layer_ratios(tc: dict, allowed: tuple[int, ...]) -> list[int]:
    n = tc["num_hidden_layers"]
    ratios = list(tc.get("compress_ratios", [0] * n))
    if len(ratios) != n:
        raise ValueError(
            f"compress_ratios has {len(ratios)} entries for {n} layers; only backbone entries are supported "
            "(trailing DSpark/MTP entries need num_nextn_predict_layers > 0, which the oracle does not support)"
        )
    bad = sorted({r for r in ratios if r not in allowed})
    if bad:
        raise ValueError(f"compress_ratios values {bad} not allowed here (allowed: {allowed})")
    return ratios


def _check_unsupported(tc: dict) -> None:
    if tc.get("engram_layer_ids"):
        raise ValueError("Engram (engram_layer_ids non-empty) is not supported by the oracle weight generator")
    if tc.get("num_nextn_predict_layers", 0):
        raise ValueError("DSpark/MTP (num_nextn_predict_layers > 0, mtp.* tensors) is not supported here")
    if tc.get("num_key_value_heads", 1) != 1:
        raise ValueError("DeepSeek-V4/V4.1 use a single shared K=V head (num_key_value_heads must be 1)")


def _block_specs(tc: dict, p: str, hash_layer: bool) -> dict:
    """Tensors every block has (release §6.2), as name -> (shape, kind)."""
    D, H, d = tc["hidden_size"], tc["num_attention_heads"], tc["head_dim"]
    q, G, o = tc["q_lora_rank"], tc["o_groups"], tc["o_lora_rank"]
    E, I, k = tc["n_routed_experts"], tc["moe_intermediate_size"], tc["num_experts_per_tok"]
    Is = I * tc.get("n_shared_experts", 1)
    hc = tc["hc_mult"]
    s = {
        f"{p}attn_norm.weight": ((D,), "norm"),
        f"{p}ffn_norm.weight": ((D,), "norm"),
        f"{p}attn.wq_a.weight": ((q, D), "linear"),
        f"{p}attn.q_norm.weight": ((q,), "norm"),
        f"{p}attn.wq_b.weight": ((H * d, q), "linear"),
        f"{p}attn.wkv.weight": ((d, D), "linear"),
        f"{p}attn.kv_norm.weight": ((d,), "norm"),
        f"{p}attn.wo_a.weight": ((G * o, H * d // G), "linear"),
        f"{p}attn.wo_b.weight": ((D, G * o), "linear"),
        f"{p}attn.attn_sink": ((H,), "sink"),
        f"{p}ffn.gate.weight": ((E, D), "linear"),
        f"{p}ffn.shared_experts.w1.weight": ((Is, D), "linear"),
        f"{p}ffn.shared_experts.w3.weight": ((Is, D), "linear"),
        f"{p}ffn.shared_experts.w2.weight": ((D, Is), "linear"),
    }
    if hash_layer:
        s[f"{p}ffn.gate.tid2eid"] = ((tc["vocab_size"], k), "tid2eid")
    else:
        s[f"{p}ffn.gate.bias"] = ((E,), "gate_bias")
    for e in range(E):
        s[f"{p}ffn.experts.{e}.w1.weight"] = ((I, D), "linear")
        s[f"{p}ffn.experts.{e}.w3.weight"] = ((I, D), "linear")
        s[f"{p}ffn.experts.{e}.w2.weight"] = ((D, I), "linear")
    for sub in ("attn", "ffn"):
        s[f"{p}hc_{sub}_fn"] = (((2 + hc) * hc, hc * D), "hc_fn")
        s[f"{p}hc_{sub}_base"] = (((2 + hc) * hc,), "hc_base")
        s[f"{p}hc_{sub}_scale"] = ((3,), "hc_scale")
    return s


def _v4_compressor_specs(tc: dict, p: str, ratio: int) -> dict:
    D, d = tc["hidden_size"], tc["head_dim"]
    s = {}
    if ratio == 4:  # CSA: two overlapping series (Ca|Cb) -> 2*d wide, plus the indexer's own compressor
        di, ni = tc["index_head_dim"], tc["index_n_heads"]
        for c, w in ((f"{p}attn.compressor.", d), (f"{p}attn.indexer.compressor.", di)):
            s[c + "wkv.weight"] = ((2 * w, D), "linear")
            s[c + "wgate.weight"] = ((2 * w, D), "linear")
            s[c + "ape"] = ((4, 2 * w), "ape")
            s[c + "norm.weight"] = ((w,), "norm")
        s[f"{p}attn.indexer.wq_b.weight"] = ((ni * di, tc["q_lora_rank"]), "linear")
        s[f"{p}attn.indexer.weights_proj.weight"] = ((ni, D), "linear")
    elif ratio == 128:  # HCA: no overlap, no indexer
        s[f"{p}attn.compressor.wkv.weight"] = ((d, D), "linear")
        s[f"{p}attn.compressor.wgate.weight"] = ((d, D), "linear")
        s[f"{p}attn.compressor.ape"] = ((128, d), "ape")
        s[f"{p}attn.compressor.norm.weight"] = ((d,), "norm")
    return s


def _v41_extra_specs(tc: dict, p: str, layer: int, ratio: int) -> dict:
    D, d, q = tc["hidden_size"], tc["head_dim"], tc["q_lora_rank"]
    di, ni = tc["index_head_dim"], tc["index_n_heads"]
    s = {}
    if layer in tc.get("kv_source_layer_ids", []):
        s[f"{p}attn.compressor.wkv.weight"] = ((d, D), "linear")
        s[f"{p}attn.compressor.norm.weight"] = ((d,), "norm")
        if ratio == 2:  # ratio 1 has no gate (softmax over a single token)
            s[f"{p}attn.compressor.wgate.weight"] = ((d, D), "linear")
        s[f"{p}attn.indexer.wk.weight"] = ((di, d), "linear")
        s[f"{p}attn.indexer.k_norm.weight"] = ((di,), "norm")
    if layer in tc.get("index_source_layer_ids", []):
        s[f"{p}attn.indexer.wq_b.weight"] = ((ni * di, q), "linear")
        s[f"{p}attn.indexer.weights_proj.weight"] = ((ni, D), "linear")
    return s


def release_tensor_specs(config: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """Release tensor name -> (shape, init kind) for a parsed release config."""
    variant = model_variant(config)
    tc = text_config(config)
    _check_unsupported(tc)
    n, D, V, hc = tc["num_hidden_layers"], tc["hidden_size"], tc["vocab_size"], tc["hc_mult"]
    specs = {
        "embed.weight": ((V, D), "embed"),
        "head.weight": ((V, D), "head"),
        "norm.weight": ((D,), "norm"),
    }
    if variant == "v4":
        ratios = _layer_ratios(tc, V4_RATIOS)
        n_hash = tc.get("num_hash_layers", 0)
        for L in range(n):
            p = f"layers.{L}."
            specs.update(_block_specs(tc, p, hash_layer=L < n_hash))
            specs.update(_v4_compressor_specs(tc, p, ratios[L]))
        specs["hc_head_fn"] = ((hc, hc * D), "hc_fn")
        specs["hc_head_base"] = ((hc,), "hc_base")
        specs["hc_head_scale"] = ((1,), "hc_scale")
    else:
        ratios = _layer_ratios(tc, V41_RATIOS)
        if tc.get("num_hash_layers", 0):
            raise ValueError("V4.1 has no hash-routed layers (num_hash_layers must be 0/absent)")
        for key in ("kv_source_layer_ids", "index_source_layer_ids"):
            for L in tc.get(key, []):
                if not (0 <= L < n and ratios[L] > 0):
                    raise ValueError(f"{key} entry {L} is not a compressed backbone layer")
        for L in range(n):
            p = f"layers.{L}."
            specs.update(_block_specs(tc, p, hash_layer=False))
            specs.update(_v41_extra_specs(tc, p, L, ratios[L]))
    return specs


def _draw(rng: np.random.Generator, shape: tuple[int, ...], kind: str, tc: dict) -> np.ndarray:
    if kind == "tid2eid":
        # distinct experts per token row: first k columns of a random permutation of the experts
        keys = rng.random((shape[0], tc["n_routed_experts"]))
        return np.argsort(keys, axis=1)[:, : shape[1]].astype(np.int32)
    x = rng.standard_normal(shape)
    if kind == "linear":
        x = x / np.sqrt(shape[-1])  # unit-variance outputs for unit-RMS inputs
    elif kind == "norm":
        x = 1.0 + 0.1 * x
    elif kind == "sink":
        x = 0.5 * x
    elif kind == "hc_fn":
        # fn @ rms-normalised streams ~ N(0, 1): pre/post/comb differ clearly between tokens
        x = x / np.sqrt(shape[-1])
    elif kind in ("hc_base", "gate_bias", "ape"):
        x = 0.1 * x
    elif kind == "hc_scale":
        x = 0.5 + 0.1 * x
    elif kind == "embed":
        x = 0.5 * x
    elif kind == "head":
        x = x / np.sqrt(shape[-1])  # final hidden has unit RMS -> logits ~ N(0, 1), a span of a few units
    else:
        raise AssertionError(kind)
    return x.astype(np.float32)


def random_release_weights(config: dict, seed: int) -> dict[str, np.ndarray]:
    """Random tensors under the release names for ``config`` (see module docstring)."""
    specs = release_tensor_specs(config)
    tc = text_config(config)
    rng = np.random.default_rng(seed)
    return {name: _draw(rng, *specs[name], tc) for name in sorted(specs)}


def weights_digest(weights: dict[str, np.ndarray]) -> dict[str, float]:
    """Per-tensor float64 position-weighted sum, to detect generator drift.

    The weights ``1 + (i mod 7)`` over the flattened index make the digest
    sensitive to reorderings/transposes, which a plain sum is not.
    """
    out = {}
    for name in sorted(weights):
        x = np.asarray(weights[name]).astype(np.float64).ravel()
        w = 1.0 + (np.arange(x.size) % 7)
        out[name] = float(np.dot(x, w))
    return out
