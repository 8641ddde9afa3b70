"""The serving runtime's steps of a full-size model lowered on an abstract mesh: nothing is allocated.

    python -m serving.bench.sharding_report --lower --preset v41-flash -tp 4 [--prefill-tokens 8192] [--decode-batch 64]

The parameters are ShapeDtypeStructs in the release formats (`sharding_report.model_params`) carrying the
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

import re
import time
from collections import defaultdict
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
from serving.bench.sharding_report import abstract_mesh
from serving.runtime.config import RuntimeConfig
from serving.runtime.runner import Runner
from sharding import rules
from sharding.expert_dispatch import ExpertDispatch
from sharding.mesh import ParallelConfig, make_mesh
from sharding.model import decode_unsplittable_experts, install_dispatch
from sharding.runtime import MeshPlacement

_SHLO_OP = re.compile(r"stablehlo\.(all_reduce|all_gather|reduce_scatter|all_to_all|collective_permute)\b")
_FUNC = re.compile(r"func\.func (?:public |private )?@([\w.$-]+)\(")
_CALL = re.compile(r"call @([\w.$-]+)\(")
_TENSOR = re.compile(r"tensor<((?:\d+x)*)([a-z]+[0-9a-zA-Z]*)>")
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "i32": 4, "ui32": 4, "i8": 1, "ui8": 1, "i1": 1, "i64": 8, "f64": 8,
          "f8E4M3FN": 1}


@dataclass(frozen=True)
class AbstractPlacement(MeshPlacement):
    """A MeshPlacement whose arrays are ShapeDtypeStructs on their shardings (for tracing, never run)."""

    def zeros(self, rank_shapes, *, cache: bool = False):
        shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct((self.ranks * s.shape[0], *s.shape[1:]), s.dtype),
                              rank_shapes)
        shardings = (rules.cache_shardings(self.mesh, shapes) if cache
                     else jax.tree.map(lambda s: self.rows_sharding(len(s.shape)), shapes))
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)

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


def _tensor_bytes(types: str) -> int:
    return sum(_BYTES.get(dt, 4) * int(np.prod([int(d) for d in dims.split("x") if d] or [1]))
               for dims, dt in _TENSOR.findall(types))


def stablehlo_collectives(text: str) -> dict[str, dict[str, int]]:
    """{op: {count, bytes}} of the explicit collectives in StableHLO text (result tensor types, per device),
    each function's counted as many times as it is called from @main."""
    direct: dict[str, list[tuple[str, int]]] = defaultdict(list)
    calls: dict[str, list[str]] = defaultdict(list)
    fn, pending = "", None
    for line in text.splitlines():
        if m := _FUNC.search(line):
            fn = m.group(1)
            continue
        if m := _SHLO_OP.search(line):
            if line.rstrip().endswith("({"):  # a reduction region: the types close it
                pending = m.group(1)
            else:
                direct[fn].append((m.group(1), _tensor_bytes(line.rsplit("->", 1)[-1])))
        elif pending and line.lstrip().startswith("})"):
            direct[fn].append((pending, _tensor_bytes(line.rsplit("->", 1)[-1])))
            pending = None
        for callee in _CALL.findall(line):
            calls[fn].append(callee)

    out: dict[str, dict[str, int]] = defaultdict(lambda: {"count": 0, "bytes": 0})

    def visit(f: str, times: int, depth: int = 0) -> None:
        if depth > 64:
            raise ValueError(f"call depth over 64 at @{f}")
        for op, nbytes in direct.get(f, ()):
            out[op]["count"] += times
            out[op]["bytes"] += times * nbytes
        for callee in calls.get(f, ()):
            visit(callee, times, depth + 1)

    visit("main", 1)
    return dict(out)


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


def lower_bucket(runner: Runner, segment: str, tokens: int, platform: str = "cuda"):
    """(lowered, seconds) of one segment bucket (`segment` "seg1" or "seg2", `tokens` rows per dp rank)."""
    b = runner._example(tokens, tokens)
    batch = runner._put_step(b.segment1() if segment == "seg1" else b.segment2())
    t = time.perf_counter()
    prev = runner._prev_arg() if segment == "seg1" else ()  # the program the runner compiles (async scheduling)
    lowered = runner._fns[segment].trace(runner.param_leaves, runner.cache, runner.carry_buf, batch, *prev).lower(
        lowering_platforms=(platform,))
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
        ops: dict[str, dict[str, int]] = defaultdict(lambda: {"count": 0, "bytes": 0})
        for seg in ("seg1", "seg2"):
            lowered, seconds = lower_bucket(runner, seg, tokens, platform)
            text = lowered.as_text()
            step["lower_s"] = round(step["lower_s"] + seconds, 1)
            step["stablehlo_chars"] += len(text)
            if compile:
                t = time.perf_counter()
                lowered.compile()
                step.setdefault("compile_s", {})[seg] = round(time.perf_counter() - t, 1)
            for op, v in stablehlo_collectives(text).items():
                ops[op]["count"] += v["count"]
                ops[op]["bytes"] += v["bytes"]
        step["explicit_collectives"] = dict(ops)
        step["explicit_collective_bytes"] = sum(v["bytes"] for v in ops.values())
        out["steps"][name] = step
    return out
