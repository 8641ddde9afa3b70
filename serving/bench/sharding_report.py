"""Per-device memory and collective traffic of a layout.

    python -m serving.bench.sharding_report --preset v41-flash --tensor-parallel-size 4
    python -m serving.bench.sharding_report --preset v41-flash --data-parallel-size 8 --enable-expert-parallel \\
        --num-cpu-devices 8

Parameter and KV bytes per device: the rules table applied to the preset's abstract parameter shapes
(`nnx.eval_shape`, nothing allocated) and to the runtime's KV-cache layout (KV per cached token and per
request slot; the factor by which a token's KV is stored more than once, tp for the replicated latent).
Collective bytes: counted in the compiled HLO (`.lower().compile().as_text()`, every all-reduce,
all-gather, reduce-scatter, all-to-all and collective-permute with its result shape) of the prefill of
`--prefill-tokens` tokens and of one decode step of `--decode-batch` requests through the runtime's two
segments. Compiling the full-size model on this CPU is too heavy, so that part runs on `--hlo-preset`
(default small) with random weights; its per-token numbers scale with hidden size and layer count. The
dispatch compiles with one capacity bucket (the worst case) so each collective is counted once.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict

import jax
import numpy as np
from jax.sharding import AbstractMesh

from dsv41.api import abstract_params
from dsv41.config import load_config
from serving.runtime.kv_cache import FORMATS, CacheLayout, smallest_block_size
from sharding import rules
from sharding.mesh import MESH_AXES, ParallelConfig

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
    return AbstractMesh(tuple(f[a] for a in MESH_AXES), MESH_AXES)


def memory_report(preset: str, pc: ParallelConfig, *, dtype: str = "bfloat16", kv_format: str = "release",
                  block_size: int = 256) -> dict:
    c = load_config(preset)
    pc.check_model(c)
    mesh = abstract_mesh(pc)
    _, abstract = abstract_params(c, jax.numpy.dtype(dtype))
    total = per_device = engram = 0
    for path, s in abstract.items():
        nbytes = int(np.prod(s.shape)) * s.dtype.itemsize
        if rules.path_key(path).endswith("engram.embed.weight"):  # host-resident tables (serving spec §6)
            engram += nbytes
            continue
        total += nbytes
        per_device += nbytes // _shard_factor(mesh, rules.to_spec(mesh, rules.param_logical(path), s.shape))
    layout = CacheLayout(c, pc.data_parallel_size, block_size, pc.data_parallel_size, kv_format, dtype)
    replication = pc.tensor_parallel_size  # rows are replicated over tp, split over dp
    return {"preset": preset, "layout": pc.describe(), "param_dtype": dtype,
            "param_bytes_total": total, "param_bytes_per_device": per_device,
            "engram_table_bytes_host_resident": engram,
            "kv_format": kv_format,
            "kv_global_bytes_per_token": layout.bytes_per_block() / block_size,
            "kv_swa_and_tail_bytes_per_request": layout.bytes_per_slot(),
            "kv_copies_per_token": replication,
            "kv_note": (f"a cached token's KV lives on the {replication} tp rank(s) of its request's dp rank: "
                        f"the single latent is replicated over tp (x{replication} memory per token)"),
            "replicated_fallbacks": rules.fallbacks(mesh, {p: s.shape for p, s in abstract.items()})}


def collective_bytes(hlo_text: str) -> dict[str, dict[str, int]]:
    """{op: {count, bytes}} of the collectives in a compiled HLO module (result shapes)."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"count": 0, "bytes": 0})
    for m in _OP.finditer(hlo_text):
        shape, op = m.groups()
        nbytes = sum(_DTYPE_BYTES.get(dt, 4) * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
                     for dt, dims in re.findall(r"([a-z0-9]+)\[([0-9,]*)\]", shape))
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
    ap.add_argument("--hlo-preset", default="small", help="config compiled for the collective counts")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-dtype", default="release", choices=FORMATS)
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
    out = memory_report(a.preset, pc, dtype=a.dtype, kv_format=a.kv_cache_dtype)
    if not a.no_hlo:
        if jax.device_count() < pc.world_size:
            raise SystemExit(f"{pc.world_size} devices needed for the HLO part; on CPU add "
                             f"--num-cpu-devices {pc.world_size}")
        out.update(hlo_report(a.hlo_preset, pc, prefill_tokens=a.prefill_tokens, decode_batch=a.decode_batch))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
