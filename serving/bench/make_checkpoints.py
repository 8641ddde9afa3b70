"""`python -m serving.bench.make_checkpoints OUTDIR [--size tiny|peer]`: a V4 and a V4.1 checkpoint of
matching dimensions with deterministic random weights, for the side-by-side benchmark.

OUTDIR/v4 is what HF transformers can run (it has no V4.1 class); OUTDIR/v41 is what our server runs.
Both are release-layout folders (config.json + model.safetensors, unquantized, `--dtype`) written by
`dsv41.checkpoint.save_checkpoint`, the layout `dsv41.load` and HF's `from_pretrained` both read.
The V4.1 model keeps every dimension of the V4 one; only the attention layout differs as the families
require: V4 ratios 0 / 4 (CSA) / 128 (HCA) / 4 with a hash-routed first layer, V4.1 ratios 0 / 2 / 1 / 1
with layers 1 and 2 as KV sources, 1-3 as index sources and layer 2 as the candidate source for layer 3's
top-k (layer 3 a CED decoder layer), no Engram and no DSpark.
`peer` is the 78.5M-parameter V4 the peer tooling measured vLLM and HF on (`../shared/peer/make_tiny_v4.py`).
Both folders get the built-in byte-level tokenizer (`serving.text.tokenizer.byte_level_tokenizer`, V4.1
special tokens) when that module is present; the benchmark itself sends token ids and needs none.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

_YARN_TINY = {"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 256, "beta_fast": 32,
              "beta_slow": 1}
_YARN_PEER = {"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 4096, "beta_fast": 32,
              "beta_slow": 1}

SIZES = {
    "tiny": {"vocab_size": 512, "hidden_size": 64, "num_attention_heads": 4, "head_dim": 32, "qk_rope_head_dim": 8,
             "q_lora_rank": 32, "o_lora_rank": 16, "o_groups": 2, "moe_intermediate_size": 32,
             "n_routed_experts": 8, "num_experts_per_tok": 2, "sliding_window": 64, "index_n_heads": 4,
             "index_head_dim": 16, "index_topk": 32, "max_position_embeddings": 4096, "rope_scaling": _YARN_TINY},
    "peer": {"vocab_size": 8192, "hidden_size": 512, "num_attention_heads": 8, "head_dim": 512,
             "qk_rope_head_dim": 64, "q_lora_rank": 256, "o_lora_rank": 256, "o_groups": 2,
             "moe_intermediate_size": 128, "n_routed_experts": 64, "num_experts_per_tok": 6,
             "sliding_window": 128, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
             "max_position_embeddings": 65536, "rope_scaling": _YARN_PEER},
}
_COMMON = {"num_hidden_layers": 4, "num_key_value_heads": 1, "n_shared_experts": 1, "scoring_func": "sqrtsoftplus",
           "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
           "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
           "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "num_nextn_predict_layers": 0,
           "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False}


def release_configs(size: str) -> tuple[dict, dict]:
    """(V4 release config dict, V4.1 release config dict) with the same dimensions."""
    if size not in SIZES:
        raise ValueError(f"unknown --size {size!r}; sizes are {', '.join(SIZES)}")
    dims = {**_COMMON, **SIZES[size]}
    v4 = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", **dims,
          "compress_ratios": [0, 4, 128, 4], "num_hash_layers": 1}
    # candidate block size x count covers index_topk ((K - 1) x size + 1 >= topk, config validation)
    block = 4 if dims["index_topk"] <= 64 else 16
    text = {"model_type": "deepseek_v41_text", **dims, "compress_ratios": [0, 2, 1, 1],
            "kv_source_layer_ids": [1, 2], "index_source_layer_ids": [1, 2, 3], "candidate_source_layer_id": 2,
            "candidate_block_size": block, "candidate_topk_blocks": -(-(dims["index_topk"] - 1) // block) + 1,
            "engram_layer_ids": []}
    v41 = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
           "bos_token_id": dims["bos_token_id"], "eos_token_id": dims["eos_token_id"], "text_config": text}
    return v4, v41


def write_checkpoint(folder: Path, release: dict, seed: int, dtype: str) -> int:
    """Random weights for `release` -> folder (release layout). Returns the parameter count."""
    import dsv41
    from dsv41.checkpoint import save_checkpoint

    config = dsv41.ModelConfig.from_release_dict(release, source=str(folder))
    model = dsv41.random_model(config, seed=seed, dtype=dtype)
    folder.mkdir(parents=True, exist_ok=True)
    save_checkpoint(folder, config, {p: np.asarray(v) for p, v in model.params.items()}, quantize=False)
    return sum(int(np.prod(v.shape)) for v in model.params.values())


def write_tokenizer(folder: Path, vocab_size: int) -> bool:
    """The byte-level tokenizer into `folder`; False when `serving.text.tokenizer` is not installed."""
    try:
        from serving.text.tokenizer import byte_level_tokenizer
    except ImportError:
        return False
    byte_level_tokenizer(vocab_size).write(folder)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m serving.bench.make_checkpoints", description=__doc__.split("\n\n")[0])
    p.add_argument("outdir", type=Path)
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="stored weight dtype")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    v4, v41 = release_configs(args.size)
    counts, tokenizer = {}, False
    for name, release in (("v4", v4), ("v41", v41)):
        counts[name] = write_checkpoint(args.outdir / name, release, args.seed, args.dtype)
        tokenizer = write_tokenizer(args.outdir / name, v4["vocab_size"])
        print(f"{args.outdir / name}: {release['model_type']}, {counts[name] / 1e6:.2f}M parameters")
    (args.outdir / "make_checkpoints.json").write_text(json.dumps(
        {"size": args.size, "dtype": args.dtype, "seed": args.seed, "parameters": counts,
         "tokenizer": "byte-level" if tokenizer else None}, indent=1))
    print("tokenizer.json: the byte-level tokenizer" if tokenizer else
          "no tokenizer.json (serving.text.tokenizer is not installed): token-id prompts only")
    return 0


if __name__ == "__main__":
    sys.exit(main())
