"""The checks a `ModelConfig` passes when it is made: every one refuses with a `ConfigError` that names the field
(and the config.json it came from)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dsv41.config import ModelConfig


class ConfigError(ValueError):
    """A config.json field is missing, malformed or inconsistent; the message names the field."""


def _fail(c: ModelConfig, msg: str) -> None:
    raise ConfigError(f"{c.source + ': ' if c.source else ''}{msg}")


def validate(c: ModelConfig) -> None:
    """Refuse an inconsistent config, naming the field."""
    L = c.num_hidden_layers
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                 "q_lora_rank", "o_lora_rank", "o_groups", "n_routed_experts", "num_experts_per_tok",
                 "moe_intermediate_size", "sliding_window", "hc_mult", "hc_sinkhorn_iters",
                 "max_position_embeddings"):
        if getattr(c, name) <= 0:
            _fail(c, f"{name} must be positive, got {getattr(c, name)}")
    if len(c.compress_ratios) != L:
        _fail(c, f"compress_ratios has {len(c.compress_ratios)} entries for {L} layers")
    if c.qk_rope_head_dim <= 0 or c.qk_rope_head_dim % 2 or c.qk_rope_head_dim > c.head_dim:
        _fail(c, f"qk_rope_head_dim {c.qk_rope_head_dim} must be even and within head_dim {c.head_dim}")
    if c.num_attention_heads % c.o_groups:
        _fail(c, f"num_attention_heads {c.num_attention_heads} is not a multiple of o_groups {c.o_groups}")
    if c.num_experts_per_tok > c.n_routed_experts:
        _fail(c, f"num_experts_per_tok {c.num_experts_per_tok} exceeds n_routed_experts {c.n_routed_experts}")
    if c.rms_norm_eps < 0:
        _fail(c, "rms_norm_eps must be >= 0")
    allowed = {0, 1, 2} if c.family == "v41" else {0, 4, 128}
    for i, r in enumerate(c.compress_ratios):
        if r not in allowed:
            _fail(c, f"compress_ratios[{i}] = {r} is unknown for a {c.family} model (allowed: {sorted(allowed)})")
    compressed = [i for i, r in enumerate(c.compress_ratios) if r > 0]
    if compressed:
        if c.index_n_heads <= 0 or c.index_head_dim <= 0 or c.index_topk <= 0:
            _fail(c, "compressed layers need index_n_heads, index_head_dim and index_topk > 0")
        if c.index_head_dim < c.qk_rope_head_dim:
            _fail(c, f"index_head_dim {c.index_head_dim} is smaller than qk_rope_head_dim {c.qk_rope_head_dim}")
        if c.rope_scaling is None:
            _fail(c, "compressed layers use YaRN: rope_scaling is required")
    if c.family == "v41":
        _validate_v41_sharing(c, compressed)
        if c.num_hash_layers:
            _fail(c, "num_hash_layers: V4.1 has no hash-routed layers")
    else:
        if c.kv_source_layer_ids or c.index_source_layer_ids or c.candidate_source_layer_id is not None:
            _fail(c, "kv_source_layer_ids / index_source_layer_ids / candidate_source_layer_id are V4.1 fields")
        if not 0 <= c.num_hash_layers <= L:
            _fail(c, f"num_hash_layers {c.num_hash_layers} out of range")
        if c.engram_layer_ids:
            _fail(c, "engram_layer_ids: Engram is a V4.1 module")
    _validate_engram(c)
    if c.family == "v41" and c.num_nextn_predict_layers:
        for name in ("dspark_block_size", "dspark_markov_rank", "dspark_n_routed_experts",
                     "dspark_num_experts_per_tok"):
            if getattr(c, name) <= 0:
                _fail(c, f"{name} must be positive when num_nextn_predict_layers > 0")
        bad = [t for t in c.dspark_target_layer_ids if not 0 <= t < L]
        if not c.dspark_target_layer_ids or bad:
            _fail(c, f"dspark_target_layer_ids {list(c.dspark_target_layer_ids)} must name backbone layers")
        if c.dspark_num_experts_per_tok > c.dspark_n_routed_experts:
            _fail(c, "dspark_num_experts_per_tok exceeds dspark_n_routed_experts")


def _validate_v41_sharing(c: ModelConfig, compressed: list[int]) -> None:
    L = c.num_hidden_layers
    for name in ("kv_source_layer_ids", "index_source_layer_ids"):
        ids = getattr(c, name)
        if sorted(set(ids)) != list(ids):
            _fail(c, f"{name} must be strictly increasing, got {list(ids)}")
        for s in ids:
            if not 0 <= s < L or c.compress_ratios[s] == 0:
                _fail(c, f"{name} entry {s} is not a compressed backbone layer")
    for layer in compressed:
        kv = [s for s in c.kv_source_layer_ids if s <= layer]
        if not kv:
            _fail(c, f"layer {layer} is compressed (ratio {c.compress_ratios[layer]}) but no KV source in "
                     f"kv_source_layer_ids {list(c.kv_source_layer_ids)} is at or below it")
        if c.compress_ratios[kv[-1]] != c.compress_ratios[layer]:
            _fail(c, f"layer {layer} (ratio {c.compress_ratios[layer]}) would read the global KV of layer "
                     f"{kv[-1]} (ratio {c.compress_ratios[kv[-1]]}); ratios must match (kv_source_layer_ids)")
        idx = [s for s in c.index_source_layer_ids if s <= layer]
        if not idx:
            _fail(c, f"layer {layer} is compressed but no index source in index_source_layer_ids is at or below it")
        if max(s for s in c.kv_source_layer_ids if s <= idx[-1]) != kv[-1]:
            _fail(c, f"layer {layer} uses index source {idx[-1]}, whose top-k indexes a different KV source "
                     f"than its own ({kv[-1]}) (index_source_layer_ids)")
    cand = c.candidate_source_layer_id
    if cand is not None:
        if cand not in c.index_source_layer_ids:
            _fail(c, f"candidate_source_layer_id {cand} must be an index source")
        if c.candidate_topk_blocks <= 0 or c.candidate_block_size <= 0:
            _fail(c, "candidate_topk_blocks and candidate_block_size must be positive with a candidate source")
        if (c.candidate_topk_blocks - 1) * c.candidate_block_size + 1 < c.index_topk:
            _fail(c, f"candidate_topk_blocks x candidate_block_size ({c.candidate_topk_blocks} x "
                     f"{c.candidate_block_size}) cannot fill index_topk {c.index_topk} when the newest block "
                     "holds one row")
        cand_kv = max(s for s in c.kv_source_layer_ids if s <= cand)
        for s in c.index_source_layer_ids:
            if s > cand and max(k for k in c.kv_source_layer_ids if k <= s) != cand_kv:
                _fail(c, f"index source {s} follows the candidate source {cand} but reads another KV source")


def _validate_engram(c: ModelConfig) -> None:
    if not c.engram_layer_ids:
        return
    L = c.num_hidden_layers
    for name in ("engram_vocab_size", "engram_n_heads", "engram_head_dim", "engram_compressed_vocab_size"):
        if getattr(c, name) <= 0:
            _fail(c, f"{name} must be positive with engram_layer_ids set")
    if c.engram_max_ngram_size < 2:
        _fail(c, "engram_max_ngram_size must be >= 2")
    if c.engram_head_dim % 32:
        _fail(c, f"engram_head_dim {c.engram_head_dim} must be a multiple of 32 (FP8 row scales)")
    if sorted(set(c.engram_layer_ids)) != list(c.engram_layer_ids):
        _fail(c, f"engram_layer_ids must be strictly increasing, got {list(c.engram_layer_ids)}")
    for lid in c.engram_layer_ids:
        if not 1 <= lid < L:
            _fail(c, f"engram_layer_ids entry {lid}: Engram layers must be backbone layers >= 1")
    if len(c.engram_num_embeddings) != len(c.engram_layer_ids):
        _fail(c, "engram_num_embeddings needs one entry per engram_layer_ids entry")
    from dsv41.layers.engram import engram_primes  # local: the layout lives with the Engram module

    primes = engram_primes(len(c.engram_layer_ids), c.engram_max_ngram_size, c.engram_n_heads,
                           c.engram_vocab_size)
    for i, layer_primes in enumerate(primes):
        rows = sum(layer_primes)
        if rows != c.engram_num_embeddings[i]:
            _fail(c, f"engram_num_embeddings[{i}] = {c.engram_num_embeddings[i]} but the prime layout from "
                     f"engram_vocab_size {c.engram_vocab_size} gives {rows} rows")
