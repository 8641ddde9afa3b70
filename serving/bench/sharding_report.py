"""Per-device memory and collective traffic of a layout.

    python -m serving.bench.sharding_report --preset v41-flash --tensor-parallel-size 4 --no-hlo
    python -m serving.bench.sharding_report --preset v41-flash -tp 4 --max-model-len 131072 --num-requests 64 --no-hlo
    python -m serving.bench.sharding_report --plan --out plan.json      # the four target layouts (memory_plan)
    python -m serving.bench.sharding_report --preset v41-flash --data-parallel-size 8 --enable-expert-parallel \\
        --num-cpu-devices 8

Parameter bytes per device: the rules table applied to the preset's abstract parameter shapes
(`abstract_params`, nothing allocated), by default in the release checkpoint's formats (`--weights release`:
FP8 32x32-block linears, MXFP4 routed experts, BF16/F32 elsewhere, as they stay on the device);
`--weights dequantized` counts every weight in `--dtype`. The Engram tables (`engram.embed.weight` + `.scale`)
live in host memory, one copy per host; the device holds staging buffers for the rows a step gathers:
2 (double-buffered) x max_num_batched_tokens x Engram layers x C x (hd + hd/32) bytes, C = the hash columns
(engram_max_ngram_size - 1) x engram_n_heads, hd = engram_head_dim (FP8 row + one UE8M0 byte per 32).
KV bytes: the runtime's cache layout (`CacheLayout`: global KV + index keys per cached token, SWA rings and
compressor tails per request slot); a cached token's KV lives on every tp rank of its request's dp rank
(the single latent is replicated over tp), each dp rank holds its own requests.
Collective bytes: counted in the compiled HLO (`.lower().compile().as_text()`, every all-reduce,
all-gather, reduce-scatter, all-to-all and collective-permute with its result shape) of the prefill of
`--prefill-tokens` tokens and of one decode step of `--decode-batch` requests through the runtime's two
segments. Compiling the full-size model on this CPU is too heavy, so that part runs on `--hlo-preset`
(default small) with random weights; its per-token numbers scale with hidden size and layer count. The
dispatch compiles with one capacity bucket (the worst case) so each collective is counted once.
`--lower` lowers the full-size forward on an abstract mesh instead (`serving.bench.full_size_lowering`);
`--lower --compile` lowers it for `--num-cpu-devices` CPU devices and times XLA:CPU compiling each segment.
"""

from __future__ import annotations

import argparse
import json

import jax

from serving.bench import full_size_lowering, memory_plan
from serving.bench.hlo_text import collective_bytes, merged
from serving.bench.layout_memory import WEIGHTS, memory_report
from serving.runtime.config import RuntimeConfig
from serving.runtime.kv_cache import FORMATS, smallest_block_size
from serving.runtime.runner import Runner
from serving.runtime.programs import Program
from sharding.mesh import ParallelConfig
from sharding.runtime import MeshPlacement


def prefill_collectives(sm, tokens: int) -> dict[str, dict[str, int]]:
    """{op: {count, bytes}} of the exact forward over `tokens` ids of a `sharding.model.ShardedModel`."""
    return collective_bytes(sm.lower_logits(tokens).compile().as_text())


def decode_collectives(sm, batch: int) -> dict[str, dict[str, int]]:
    """{op: {count, bytes}} of one decode step of `batch` requests per dp rank through the runtime's two
    segments (seg1 + seg2) of a `sharding.model.ShardedModel` on its mesh."""
    block = smallest_block_size(sm.config)
    rc = RuntimeConfig(max_num_seqs=batch, max_num_batched_tokens=batch,  # per dp rank
                       max_model_len=4 * block, block_size=block, token_buckets=(batch,))
    runner = Runner(sm, rc, progress=False, placement=MeshPlacement(sm.mesh))
    segments = []
    for key in (Program.SEGMENT1.at(batch), Program.SEGMENT2.at(batch)):
        runner.compiler.precompile([key])
        segments.append(collective_bytes(runner.compiler.compiled_text(key)))
    return merged(segments)


def hlo_report(preset: str, pc: ParallelConfig, *, prefill_tokens: int, decode_batch: int) -> dict:
    import dsv41
    from sharding.model import ShardedModel

    sm = ShardedModel(dsv41.random_model(preset, seed=0), pc, capacity_buckets=1)
    prefill = prefill_collectives(sm, prefill_tokens)
    decode = decode_collectives(sm, decode_batch)
    return {"hlo_preset": preset,
            "prefill_tokens": prefill_tokens, "prefill_collectives": prefill,
            "prefill_collective_bytes_per_token": sum(v["bytes"] for v in prefill.values()) / prefill_tokens,
            "decode_batch_per_dp_rank": decode_batch, "decode_step_collectives": decode,
            "decode_collective_bytes_per_step": sum(v["bytes"] for v in decode.values())}


def main() -> None:
    from serving.engine.args import FlagError, add_flags, from_flags

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="v41-flash")
    ap.add_argument("--weights", default="release", choices=WEIGHTS,
                    help="parameters in the release checkpoint's formats, or all decoded to --dtype")
    ap.add_argument("--dtype", default="bfloat16", help="compute dtype of the unquantized (or decoded) weights")
    ap.add_argument("--kv-cache-dtype", default="release", choices=FORMATS)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192, help="per dp rank (Engram staging)")
    ap.add_argument("--max-model-len", type=int, default=None, help="with --num-requests: KV bytes per device")
    ap.add_argument("--num-requests", type=int, default=None, help="requests over the whole layout")
    ap.add_argument("--plan", action="store_true",
                    help="the memory plan of the four target layouts (Markdown table; serving.bench.memory_plan)")
    ap.add_argument("--reserve-fraction", type=float, default=0.10,
                    help="--plan: device memory kept back for activations and workspace")
    ap.add_argument("--lower", action="store_true",
                    help="lower the full-size forward and decode step on an abstract mesh "
                         "(serving.bench.full_size_lowering)")
    ap.add_argument("--compile", action="store_true",
                    help="with --lower: lower for this host's CPU devices instead (--num-cpu-devices = world size) "
                         "and compile each segment with XLA:CPU, timed - a full-size compile-time estimate")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--hlo-preset", default="small", help="config compiled for the collective counts")
    ap.add_argument("--prefill-tokens", type=int, default=64)
    ap.add_argument("--decode-batch", type=int, default=8)
    ap.add_argument("--no-hlo", action="store_true", help="only the memory part")
    add_flags(ap, ParallelConfig, "parallelism")
    a = ap.parse_args()
    try:
        pc = from_flags(ParallelConfig, a)
    except FlagError as e:
        ap.error(str(e))
    pc.use_cpu_devices()
    mem = {"weights": a.weights, "kv_format": a.kv_cache_dtype, "block_size": a.block_size,
           "max_num_batched_tokens": a.max_num_batched_tokens}
    if a.plan:
        rows = memory_plan.plan(a.preset, reserve_fraction=a.reserve_fraction, **mem)
        print(memory_plan.markdown(rows, a.reserve_fraction))
        out = {"preset": a.preset, "reserve_fraction": a.reserve_fraction, "plan": rows}
    elif a.compile and not a.lower:
        ap.error("--compile goes with --lower")
    elif a.lower:
        out = full_size_lowering.report(a.preset, pc, weights=a.weights, prefill_tokens=a.prefill_tokens,
                                        decode_batch=a.decode_batch, compile=a.compile)
        print(json.dumps(out, indent=1))
    else:
        out = memory_report(a.preset, pc, dtype=a.dtype, max_model_len=a.max_model_len,
                            num_requests=a.num_requests, **mem)
        if not a.no_hlo:
            if jax.device_count() < pc.world_size:
                raise SystemExit(f"{pc.world_size} devices needed for the HLO part; on CPU add "
                                 f"--num-cpu-devices {pc.world_size}")
            out.update(hlo_report(a.hlo_preset, pc, prefill_tokens=a.prefill_tokens, decode_batch=a.decode_batch))
        print(json.dumps(out, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
