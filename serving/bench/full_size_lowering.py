"""The serving runtime's steps of a full-size model lowered on an abstract mesh: nothing is allocated.

    python -m serving.bench.sharding_report --lower --preset v41-flash -tp 4 [--prefill-tokens 8192] [--decode-batch 64]

The parameters are ShapeDtypeStructs in the release formats (`layout_memory.model_params`) carrying the
rules table's NamedShardings on a `jax.sharding.AbstractMesh`; the KV cache, the carried rows and the batches
are ShapeDtypeStructs too (`AbstractPlacement` stands in for `MeshPlacement`, whose arrays it only
describes). A `Runner` is built over them, so its segment functions are the served ones (per-rank
shard_map, expert all-to-all dispatch, CED segments), and each is traced and lowered to StableHLO for
`--lowering-platform` (cuda) - no devices needed. Kernels: the XLA paths (`kernel_impl="xla"`; Pallas kernels
would lower the same way on a GPU host).

Collectives: StableHLO before SPMD partitioning holds only the explicit ones - the shard_map bodies' expert
all-to-alls and psums, at per-device shapes; the tensor-parallel all-reduces of the O-projection (and any
other partitioner-inserted collective) appear only after compilation, which needs real devices (an
AbstractMesh has no device assignment). The counts below are therefore the explicit collectives only.
The Engram tables live in host memory as served (`--engram-cpu-offload`): the lowered steps take each step's
gathered rows (`EngramRows`), not the tables.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41 import checkpoint, weight_formats
from dsv41.api import abstract_params
from dsv41.config import ModelConfig, load_config
from dsv41.layers.engram import EngramLayout, EngramRows
from dsv41.model import Transformer
from serving.bench.hlo_text import merged, stablehlo_collectives
from serving.bench.layout_memory import abstract_mesh
from serving.runtime.batch import token_ladder
from serving.runtime.config import RuntimeConfig
from serving.runtime.programs import Program
from serving.runtime.runner import Runner
from sharding import rules
from sharding.expert_dispatch import ExpertDispatch
from sharding.mesh import ParallelConfig, make_mesh
from sharding.model import decode_unsplittable_experts, install_dispatch
from sharding.runtime import MeshPlacement


@dataclass(frozen=True)
class AbstractPlacement(MeshPlacement):
    """A MeshPlacement whose arrays are ShapeDtypeStructs on their shardings (for tracing, never run)."""

    def zeros(self, rank_shapes, *, cache: bool = False):
        return self.global_specs(rank_shapes, cache=cache)

    def put_batch(self, batch):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype,
                                                           sharding=self.rows_sharding(max(1, np.ndim(a)))), batch)

    def put_replicated(self, tree):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype,
                                                           sharding=self.replicated), tree)


class AbstractModel:
    """What a `Runner` reads from a model (`config`, `dtype`, `module`, `engram`, `token_map`), with abstract
    parameters sharded by the rules table and the expert dispatch installed."""

    def __init__(self, c: ModelConfig, mesh, weights: str = "release", dtype=jnp.bfloat16):
        self.config, self.dtype = c, jnp.dtype(dtype)
        engram_fp8 = bool(c.engram_layer_ids)
        formats = {}
        if weights == "release":
            _, dense = abstract_params(c, self.dtype, engram_fp8)
            formats = checkpoint.release_formats(c, list(dense))
        formats.update({("layers", lid, "engram", "embed"): ("host",) for lid in c.engram_layer_ids})
        self.engram_tables = _AbstractEngramTables(c.engram_head_dim) if c.engram_layer_ids else None

        def build():
            m = weight_formats.apply(Transformer(c, dtype=self.dtype, engram_fp8=engram_fp8), formats)
            self.decoded_experts = decode_unsplittable_experts(m, mesh, self.dtype)  # none at full size
            return m

        module = nnx.eval_shape(build)
        graphdef, state = nnx.split(module)
        flat = {tuple(k): v.get_value() for k, v in nnx.to_flat_state(state)}
        shardings = rules.param_shardings(mesh, {p: tuple(s.shape) for p, s in flat.items()})
        params = {p: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=shardings[p]) for p, s in flat.items()}
        self.module = nnx.merge(graphdef, nnx.from_flat_state([(p, nnx.Param(v)) for p, v in params.items()]))
        install_dispatch(self.module, ExpertDispatch(mesh, capacity_buckets=1))  # one bucket: each a2a once
        self.engram = EngramLayout.from_config(c) if c.engram_layer_ids else None
        self.token_map = np.arange(c.vocab_size) if self.engram else None


class _AbstractEngramTables:
    """Stands in for `HostEngramTables` when lowering: rows of the right shape (zeros), no table."""

    def __init__(self, head_dim: int):
        self.head_dim = head_dim

    def gather(self, hash_ids: np.ndarray, valid: np.ndarray | None = None) -> EngramRows:
        shape = np.shape(hash_ids)
        return EngramRows(np.zeros((*shape, self.head_dim), np.uint8), np.zeros((*shape, self.head_dim // 32), np.uint8))


def build_runner(preset: str, pc: ParallelConfig, *, weights: str = "release", prefill_tokens: int = 8192,
                 decode_batch: int = 64, max_model_len: int = 131072, block_size: int = 256,
                 mesh=None) -> Runner:
    """A Runner over abstract parameters, cache and carry on the layout's abstract mesh, or on `mesh` (a
    concrete one, to compile: still nothing allocated) (per dp rank: decode_batch slots, buckets
    (decode_batch, prefill_tokens))."""
    c = load_config(preset)
    pc.check_model(c)
    mesh = abstract_mesh(pc) if mesh is None else mesh
    rc = RuntimeConfig(max_num_seqs=decode_batch, max_num_batched_tokens=prefill_tokens, max_model_len=max_model_len,
                       block_size=block_size, kv_cache_dtype="release", kernel_impl="xla",
                       token_buckets=tuple(sorted({decode_batch, prefill_tokens})))
    return Runner(AbstractModel(c, mesh, weights), rc, progress=False, placement=AbstractPlacement(mesh))


def lower_bucket(runner: Runner, segment: Program, tokens: int, platform: str = "cuda"):
    """(lowered, seconds) of one segment bucket (`segment` SEGMENT1 or SEGMENT2, `tokens` rows per dp rank)."""
    t = time.perf_counter()
    lowered = runner.compiler.lower(segment.at(tokens), lowering_platforms=(platform,))  # what the runner compiles
    return lowered, time.perf_counter() - t


def report(preset: str, pc: ParallelConfig, *, weights: str = "release", prefill_tokens: int = 8192,
           decode_batch: int = 64, platform: str = "cuda", compile: bool = False) -> dict:
    """Lowering wall time and explicit collectives of a prefill bucket and a decode step (both segments).

    `compile=True`: lowered for this host's CPU devices instead (`pc.world_size` of them: `--num-cpu-devices`)
    and compiled by XLA:CPU, whose wall time per segment (`compile_s`) estimates what a bucket of the full-size
    program costs to compile - the same program (layers unrolled, per-rank shard_map bodies), another backend:
    XLA:GPU's passes and kernel emission differ, so it is an order of magnitude, not a GPU figure."""
    mesh = None
    if compile:
        if jax.device_count() < pc.world_size:
            raise ValueError(f"compile: {pc.world_size} devices needed, {jax.device_count()} available (on CPU: "
                             f"--num-cpu-devices {pc.world_size})")
        mesh, platform = make_mesh(pc), "cpu"
    t = time.perf_counter()
    runner = build_runner(preset, pc, weights=weights, prefill_tokens=prefill_tokens, decode_batch=decode_batch,
                          mesh=mesh)
    out = {"preset": preset, "layout": pc.describe(), "weights": weights, "platform": platform,
           "runner_setup_s": round(time.perf_counter() - t, 1), "steps": {}}
    for name, tokens in (("decode", decode_batch), ("prefill", prefill_tokens)):
        step = {"tokens_per_dp_rank": tokens, "lower_s": 0.0, "stablehlo_chars": 0}
        segments = []
        for seg in (Program.SEGMENT1, Program.SEGMENT2):
            lowered, seconds = lower_bucket(runner, seg, tokens, platform)
            text = lowered.as_text()
            step["lower_s"] = round(step["lower_s"] + seconds, 1)
            step["stablehlo_chars"] += len(text)
            if compile:
                t = time.perf_counter()
                lowered.compile()
                step.setdefault("compile_s", {})[seg.value] = round(time.perf_counter() - t, 1)
            segments.append(stablehlo_collectives(text))
        ops = merged(segments)
        step["explicit_collectives"] = ops
        step["explicit_collective_bytes"] = sum(v["bytes"] for v in ops.values())
        out["steps"][name] = step
    out["default_ladder"] = default_ladder(runner.config, decode_batch, prefill_tokens, out["steps"])
    return out


def default_ladder(c, decode_batch: int, prefill_tokens: int, steps: dict) -> dict:
    """The programs a server with these capacities compiles by default (`token_ladder`'s token and kept-row buckets,
    a sampler per distinct request bucket) and, where the steps were compiled, the seconds all of them would take
    one after another on XLA:CPU: each bucket at or below `decode_batch` as the decode step's segments, each larger
    one as the prefill's (lowering included; the sampler's seconds left out)."""
    tokens = token_ladder(prefill_tokens, c.sliding_window, 1, decode_batch)
    kept = token_ladder(prefill_tokens, c.sliding_window, 1, decode_batch, kept=True)
    samplers = len({min(decode_batch, k) for k in kept})
    out = {"token_buckets": list(tokens), "kept_row_buckets": list(kept),
           "programs": len(tokens) + len(kept) + samplers}
    if all("compile_s" in s for s in steps.values()):
        def seconds(size: int, segment: str) -> float:
            s = steps["decode" if size <= decode_batch else "prefill"]
            return s["compile_s"][segment] + s["lower_s"] / 2
        out["estimated_all_compiled_s_one_thread"] = round(
            sum(seconds(t, "segment1") for t in tokens) + sum(seconds(k, "segment2") for k in kept))
    return out
