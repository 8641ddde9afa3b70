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
import functools
import json
import re
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType

from dsv41 import checkpoint
from dsv41.api import abstract_params
from dsv41.config import ModelConfig, load_config
from serving.runtime.kv_cache import FORMATS, CacheLayout, smallest_block_size
from sharding import rules
from sharding.mesh import MESH_AXES, ParallelConfig

WEIGHTS = ("release", "dequantized")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "s64": 8,
                "f64": 8, "f8e4m3fn": 1}
_OP = re.compile(r"=\s*(\(.*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+(" + "|".join(COLLECTIVES) +
                 r")(?:-start)?\(")


def _shard_factor(mesh, spec) -> int:
    n = 1
    for axes in spec:
        for a in (axes if isinstance(axes, tuple) else (axes,) if axes else ()):
            n *= mesh.shape[a]
    return n


def abstract_mesh(pc: ParallelConfig) -> AbstractMesh:
    f = pc.factors()
    return AbstractMesh(tuple(f[a] for a in MESH_AXES), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


@functools.lru_cache(maxsize=8)
def model_params(preset: str, weights: str = "release", dtype: str = "bfloat16"
                 ) -> dict[tuple, jax.ShapeDtypeStruct]:
    """{path: ShapeDtypeStruct} of every parameter as it sits in memory: `weights="release"` keeps the release
    checkpoint's formats (`checkpoint.release_formats`), "dequantized" decodes every linear to `dtype`. Engram
    tables are FP8 rows + UE8M0 scales either way (that is how a release checkpoint loads them)."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights {weights!r}: choose one of {WEIGHTS}")
    c = load_config(preset)
    engram_fp8 = bool(c.engram_layer_ids)
    _, dense = abstract_params(c, jnp.dtype(dtype), engram_fp8)
    if weights == "dequantized":
        return dense
    _, release = abstract_params(c, jnp.dtype(dtype), engram_fp8, checkpoint.release_formats(c, list(dense)))
    return release


def is_engram_table(path: tuple) -> bool:
    """`layers.N.engram.embed.{weight,scale}`: host-resident in serving."""
    return len(path) >= 3 and tuple(path[-3:-1]) == ("engram", "embed")


def engram_staging_bytes(c: ModelConfig, max_num_batched_tokens: int) -> int:
    """Device bytes of the double-buffered staging of the Engram rows one step gathers (per dp rank's batch)."""
    if not c.engram_layer_ids:
        return 0
    hd = c.engram_head_dim
    return 2 * max_num_batched_tokens * len(c.engram_layer_ids) * c.engram_hash_cols * (hd + hd // 32)


def kv_bytes_per_request(layout: CacheLayout, max_model_len: int) -> int:
    """One request's KV at max_model_len tokens: whole blocks of global KV + index keys, plus its slot (SWA
    rings of every layer, ratio-2 compressor tails)."""
    return -(-max_model_len // layout.block_size) * layout.bytes_per_block() + layout.bytes_per_slot()


def memory_report(preset: str, pc: ParallelConfig, *, weights: str = "release", dtype: str = "bfloat16",
                  kv_format: str = "release", block_size: int = 256, max_num_batched_tokens: int = 8192,
                  max_model_len: int | None = None, num_requests: int | None = None) -> dict:
    """Bytes per device of a layout (nothing allocated). With max_model_len and num_requests (over the whole
    layout, spread evenly over the dp ranks): the KV bytes per device of that many full-length requests."""
    c = load_config(preset)
    pc.check_model(c)
    mesh = abstract_mesh(pc)
    params = model_params(preset, weights, dtype)
    total = per_device = engram = 0
    for path, s in params.items():
        nbytes = int(np.prod(s.shape)) * s.dtype.itemsize
        if is_engram_table(path):
            engram += nbytes
            continue
        total += nbytes
        per_device += nbytes // _shard_factor(mesh, rules.to_spec(mesh, rules.param_logical(path), s.shape))
    layout = CacheLayout(c, pc.data_parallel_size, block_size, pc.data_parallel_size, kv_format, dtype)
    replication = pc.tensor_parallel_size  # rows are replicated over tp, split over dp
    out = {"preset": preset, "layout": pc.describe(), "weights": weights, "param_dtype": dtype,
           "param_bytes_total": total, "param_bytes_per_device": per_device,
           "engram_table_bytes_per_host": engram,
           "engram_staging_bytes_per_device": engram_staging_bytes(c, max_num_batched_tokens),
           "max_num_batched_tokens": max_num_batched_tokens,
           "kv_format": kv_format, "block_size": block_size,
           "kv_global_bytes_per_token": layout.bytes_per_block() / block_size,
           "kv_swa_and_tail_bytes_per_request": layout.bytes_per_slot(),
           "kv_copies_per_token": replication,
           "kv_note": (f"a cached token's KV lives on the {replication} tp rank(s) of its request's dp rank: "
                       f"the single latent is replicated over tp (x{replication} memory per token)"),
           "replicated_fallbacks": rules.fallbacks(mesh, {p: s.shape for p, s in params.items()})}
    if max_model_len is not None and num_requests is not None:
        per_rank = -(-num_requests // pc.data_parallel_size)
        out.update(max_model_len=max_model_len, num_requests=num_requests, requests_per_dp_rank=per_rank,
                   kv_bytes_per_request=kv_bytes_per_request(layout, max_model_len),
                   kv_bytes_per_device=per_rank * kv_bytes_per_request(layout, max_model_len))
    return out


def hlo_array_bytes(dtype: str, dims: str) -> int:
    """Bytes of an HLO array `dtype[dims]` as the text writes it ("bf16", "16,256"; "" for a scalar)."""
    return _DTYPE_BYTES.get(dtype, 4) * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))


def collective_bytes(hlo_text: str) -> dict[str, dict[str, int]]:
    """{op: {count, bytes}} of the collectives in a compiled HLO module (result shapes)."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"count": 0, "bytes": 0})
    for m in _OP.finditer(hlo_text):
        shape, op = m.groups()
        nbytes = sum(hlo_array_bytes(dt, dims) for dt, dims in re.findall(r"([a-z0-9]+)\[([0-9,]*)\]", shape))
        out[op]["count"] += 1
        out[op]["bytes"] += nbytes
    return dict(out)


def prefill_collectives(sm, tokens: int) -> dict[str, dict[str, int]]:
    """{op: {count, bytes}} of the exact forward over `tokens` ids of a `sharding.model.ShardedModel`."""
    return collective_bytes(sm.lower_logits(tokens).compile().as_text())


def decode_collectives(sm, batch: int) -> dict[str, dict[str, int]]:
    """{op: {count, bytes}} of one decode step of `batch` requests per dp rank through the runtime's two
    segments (seg1 + seg2) of a `sharding.model.ShardedModel` on its mesh."""
    from serving.runtime.config import RuntimeConfig
    from serving.runtime.runner import Runner
    from sharding.runtime import MeshPlacement

    block = smallest_block_size(sm.config)
    rc = RuntimeConfig(max_num_seqs=batch, max_num_batched_tokens=batch,  # per dp rank
                       max_model_len=4 * block, block_size=block, token_buckets=(batch,))
    runner = Runner(sm, rc, progress=False, placement=MeshPlacement(sm.mesh))
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"count": 0, "bytes": 0})
    for key in (("seg1", batch), ("seg2", batch)):
        runner.precompile([key])
        for op, v in collective_bytes(runner.compiled_text(key)).items():
            out[op]["count"] += v["count"]
            out[op]["bytes"] += v["bytes"]
    return dict(out)


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
        from serving.bench import memory_plan

        rows = memory_plan.plan(a.preset, reserve_fraction=a.reserve_fraction, **mem)
        print(memory_plan.markdown(rows, a.reserve_fraction))
        out = {"preset": a.preset, "reserve_fraction": a.reserve_fraction, "plan": rows}
    elif a.compile and not a.lower:
        ap.error("--compile goes with --lower")
    elif a.lower:
        from serving.bench import full_size_lowering

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
