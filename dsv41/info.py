"""`python -m dsv41.info CHECKPOINT_DIR_OR_PRESET`: parameter counts, layer roles and KV bytes as JSON.

Counts come from the abstract parameter shapes (nothing is allocated). "backbone" is what the release
calls the 552B model: everything except the Engram tables and the DSpark drafter. Active parameters per
token: a decode token runs every layer with its top-k routed experts (the embedding table is a lookup,
not counted); a prefill token under CED runs layers 0..cut-1 fully plus the cut layer's KV path
(mHC, attn_norm, wq_a/wkv + norms, compressor, indexer wk/k_norm) - the decoder tail is amortized away.
KV bytes per token follow the record formats of spec §4.1.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import numpy as np

from dsv41.api import abstract_params
from dsv41.config import ConfigError, ModelConfig, load_config, yarn_bounds

# Record bytes per row for a latent of d values (spec §4.1).
def global_row_bytes(d: int) -> dict[str, int]:
    return {"nvfp4": d // 2 + d // 16, "fp8": d + d // 32, "bfloat16": 2 * d}


def index_row_bytes(d: int) -> dict[str, int]:
    return {"mxfp4": d // 2 + d // 32, "fp8": d + 4 * max(1, d // 128), "bfloat16": 2 * d}


def swa_row_bytes(c: ModelConfig) -> dict[str, int]:
    d = c.head_dim
    out = {"fp8": d + d // 32, "bfloat16": 2 * d}
    if c.family == "v4":  # V4 record: FP8 no-RoPE part, BF16 RoPE part, a UE8M0 scale per 64 + pad
        out["fp8"] = c.nope_head_dim + 2 * c.qk_rope_head_dim + c.nope_head_dim // 64 + 1
    return out


def _count(paths: dict[tuple, tuple[int, ...]], pred) -> int:
    return int(sum(math.prod(s) for p, s in paths.items() if pred(p)))


def parameter_counts(c: ModelConfig) -> dict[str, int]:
    _, abstract = abstract_params(c, engram_fp8=bool(c.engram_layer_ids))
    shapes = {p: tuple(v.shape) for p, v in abstract.items()}
    is_table = lambda p: p[0] == "layers" and p[2:4] == ("engram", "embed")  # noqa: E731
    is_dspark = lambda p: p[0] == "dspark"  # noqa: E731
    backbone = _count(shapes, lambda p: not is_table(p) and not is_dspark(p))
    tables = _count(shapes, lambda p: is_table(p) and p[-1] == "weight")
    dspark = _count(shapes, is_dspark)
    expert = 3 * c.hidden_size * c.moe_intermediate_size
    unused_experts = c.num_hidden_layers * (c.n_routed_experts - c.num_experts_per_tok) * expert
    embed = c.vocab_size * c.hidden_size
    decode = backbone - embed - unused_experts

    def layer_params(i: int, pred=lambda p: True) -> int:
        return _count(shapes, lambda p: p[0] == "layers" and p[1] == i and pred(p) and not is_table(p))

    active_layer = [layer_params(i) - (c.n_routed_experts - c.num_experts_per_tok) * expert
                    for i in range(c.num_hidden_layers)]
    cut = c.cut_layer
    if cut is None:
        prefill = decode
    else:
        kv_path = ("hc_attn", "attn_norm")
        kv_attn = ("wq_a", "q_norm", "wkv", "kv_norm", "compressor")
        prefill = sum(active_layer[:cut]) + layer_params(cut, lambda p: p[2] in kv_path or (
            p[2] == "attn" and (p[3] in kv_attn or (p[3] == "indexer" and p[4] in ("wk", "k_norm")))))
    return {"backbone": backbone, "engram_tables": tables, "dspark": dspark,
            "total_with_engram_and_dspark": backbone + tables + dspark,
            "active_per_decode_token": decode, "active_per_prefill_token": prefill}


def kv_bytes(c: ModelConfig) -> dict:
    sources = [r for r in c.roles if r.is_kv_source]
    rows = sum(1 / r.compress_ratio for r in sources)
    index_rows = sum(1 / r.compress_ratio for r in sources if (r.attn_kind in ("compressed", "csa")))
    g, ix = global_row_bytes(c.head_dim), index_row_bytes(c.index_head_dim or 128)
    swa = swa_row_bytes(c)
    per_token = {
        "nvfp4+mxfp4": rows * g["nvfp4"] + index_rows * ix["mxfp4"],
        "fp8+fp8": rows * g["fp8"] + index_rows * ix["fp8"],
        "bfloat16": rows * g["bfloat16"] + index_rows * ix["bfloat16"],
    }
    W, L = c.sliding_window, c.num_hidden_layers
    return {
        "global_rows_per_token": rows, "index_key_rows_per_token": index_rows,
        "global_kv_per_token": {k: round(v, 3) for k, v in per_token.items()},
        "record_bytes": {"global_row": g, "index_key_row": ix, "swa_row": swa},
        "swa_per_request": {k: L * W * v for k, v in swa.items()},
        "swa_per_token_if_every_position_cached": {k: L * v for k, v in swa.items()},
    }


def layer_table(c: ModelConfig) -> list[dict]:
    out = []
    for r in c.roles:
        rope = {"kind": r.rope, "theta": c.rope_theta if r.rope == "main" else c.compress_rope_theta}
        if r.rope == "compress" and c.rope_scaling is not None:
            low, high = yarn_bounds(c)
            rope["yarn"] = {"factor": c.rope_scaling.factor, "ramp_pairs": [low, high]}
        out.append({"layer": r.layer_id, "compress_ratio": r.compress_ratio, "attention": r.attn_kind,
                    "kv_source": r.kv_source, "index_source": r.index_source, "owns_global_kv": r.is_kv_source,
                    "runs_indexer": r.is_index_source, "candidate_source": r.is_candidate_source,
                    "uses_candidates": r.uses_candidates, "engram": r.engram_index is not None,
                    "hash_routed": r.hash_routed, "rope": rope})
    return out


def info(c: ModelConfig) -> dict:
    return {"family": c.family, "source": c.source, "layers": c.num_hidden_layers, "ced_cut_layer": c.cut_layer,
            "parameters": parameter_counts(c), "kv_cache_bytes": kv_bytes(c), "roles": layer_table(c)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv41.info", description=__doc__.splitlines()[0])
    ap.add_argument("model", help="checkpoint folder, config.json, or preset (v41-flash, v4-flash, tiny, small)")
    args = ap.parse_args(argv)
    try:
        c = load_config(args.model)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    json.dump(info(c), sys.stdout, indent=1, default=lambda o: o.item() if isinstance(o, np.generic) else str(o))
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
