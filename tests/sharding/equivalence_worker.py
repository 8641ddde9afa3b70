"""Run in a subprocess with 8 virtual CPU devices: the sharded layouts against the single-device model.

For each layout: prefill logits of `ShardedModel.logits` vs `dsv41.Model.logits` on every row, and a
runtime session on the mesh (one prefill chunk, then decode steps of one token with the cache) vs the
full-sequence logits of the same tokens. Prints one JSON object {layout: {prefill, decode, ...}}.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.sharding.equivalence_worker \\
        --preset tiny --layouts tp4,dep2x4,dep4x2,dep8x8 --decode-layouts all
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from serving.runtime.programs import Program

LAYOUTS = {  # name -> (tensor_parallel_size, data_parallel_size, enable_expert_parallel, expert_parallel_size)
    "tp4": (4, 1, False, None),
    "dep2x4": (4, 2, True, 4),
    "dep4x2": (2, 4, True, 2),
    "dep8x8": (1, 8, True, 8),
    "dp2tp4": (4, 2, False, None),  # data-parallel attention, experts tensor-parallel over all 8 devices
}
PROMPT, DECODE = 16, 3
_RELEASE_FOLDERS: list = []  # the release checkpoints' temporary folders, kept until the process exits


def run(*args: str) -> dict:
    """This worker in a subprocess on 8 virtual CPU devices (the calling process may have initialised jax with
    another device count) -> its JSON."""
    from tests.conftest import HANG_TIMEOUT_S, xla_env

    # No persistent XLA cache for this worker: on jax 0.12 a mesh step loaded from it stalled in a CPU all-reduce
    # (8 device threads expected at the rendezvous, 4 arrived; a 40 s abort). The executable cache is not JAX's.
    proc = subprocess.run([sys.executable, "-m", "tests.sharding.equivalence_worker", *args], check=False,
                          cwd=Path(__file__).resolve().parents[2], env=xla_env(8), capture_output=True, text=True,
                          timeout=HANG_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--dispatch-reference", action="store_true",
                    help="also compare with the same expert dispatch on one device")
    ap.add_argument("--noise-floor", action="store_true",
                    help="also: how far one ulp added to every routed-expert output moves the logits")
    ap.add_argument("--eplb", action="store_true", help="also: DEP8 with EPLB placements (redundant experts)")
    ap.add_argument("--dp-batches", default="none", help="layouts also checked with several requests on different "
                                                           "data-parallel ranks in the same steps (comma list)")
    ap.add_argument("--decode-layouts", default="all", help="layouts also checked through the runtime ('all', "
                                                             "'none' or a comma list)")
    ap.add_argument("--release", action="store_true",
                    help="the model loaded from a quantized release checkpoint, weights kept in FP8 / MXFP4")
    args = ap.parse_args()

    import jax
    import dsv41
    from serving.runtime.kv_cache import smallest_block_size
    from serving.runtime.config import RuntimeConfig
    from serving.runtime.runner import Runner
    from sharding.mesh import ParallelConfig
    from sharding.model import ShardedModel
    from sharding.runtime import MeshPlacement

    if jax.device_count() < 8:
        raise SystemExit(f"needs 8 devices, got {jax.device_count()} (XLA_FLAGS not applied?)")
    model = dsv41.random_model(args.preset, seed=1)
    if args.release:
        model = release_model(model)
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(3, model.config.vocab_size - 1, PROMPT + DECODE)]
    ref = model.logits(np.array(tokens))  # [T, V] on one device, dense reference MoE
    # The same expert dispatch on one device: isolates what the sharding changes from the float32
    # summation order of the routed experts (per expert, then over the k choices).
    out = {"reference": {"max_abs_logit": float(np.abs(ref).max())}}
    ref_dispatch = None
    if args.dispatch_reference:
        ref_dispatch = ShardedModel(model, ParallelConfig()).logits(np.array(tokens))
        out["reference"]["dispatch_vs_dense_max_abs_err"] = float(np.abs(ref_dispatch - ref).max())
    if args.noise_floor:
        out["reference"]["one_ulp_expert_noise"] = one_ulp_noise(model, tokens, ref)
    c = model.config
    block = smallest_block_size(c)
    rc = RuntimeConfig(max_num_seqs=8, max_num_batched_tokens=PROMPT, max_model_len=64, block_size=block,
                       token_buckets=(PROMPT,), swa_bounded_replay=False)
    one_device_runtime = None
    for name in args.layouts.split(","):
        t0 = time.perf_counter()
        sm = ShardedModel(model, ParallelConfig(*LAYOUTS[name]))
        got = sm.logits(np.array(tokens))
        res = {"prefill_max_abs_err": float(np.abs(got - ref).max())}
        if ref_dispatch is not None:
            res["prefill_vs_one_device_dispatch"] = float(np.abs(got - ref_dispatch).max())
        runner = None
        if args.decode_layouts == "all" or name in args.decode_layouts.split(","):
            runner = Runner(sm, rc, progress=False, placement=MeshPlacement(sm.mesh))
            got = np.stack(_runtime_session(runner, tokens))
            res["decode_max_abs_err"] = float(np.abs(got - ref[PROMPT - 1:]).max())
            if one_device_runtime is None:  # the same steps on one device: what the sharding alone changes
                one_device_runtime = np.stack(_runtime_session(Runner(model, rc, progress=False), tokens))
            res["decode_vs_one_device_runtime"] = float(np.abs(got - one_device_runtime).max())
            if ref_dispatch is not None:
                res["decode_vs_one_device_dispatch"] = float(np.abs(got - ref_dispatch[PROMPT - 1:]).max())
            res["cache_spec"] = str(runner.cache.swa[0].sharding.spec)
        if name in args.dp_batches.split(","):
            res["dp_batches"] = dp_batches_check(model, sm, rc, runner)
        if args.release:
            res["shard_bytes"] = shard_bytes_check(sm)
            res["decoded_experts"] = sm.decoded_experts
        res.update(layout=sm.parallel.describe(), replicated_fallbacks=sm.replicated_fallbacks,
                   seconds=round(time.perf_counter() - t0, 1))
        out[name] = res
    if args.eplb:
        out["eplb"] = eplb_check(model, tokens, ref)
    print(json.dumps(out))


def _runtime_session(runner, tokens: list[int]) -> list[np.ndarray]:
    """One prefill chunk of PROMPT tokens, then teacher-forced decode steps: each step's logits."""
    from tests.serving.driver import Driver

    runner.compiler.precompile([Program.SEGMENT1.at(PROMPT), Program.SEGMENT2.at(PROMPT)])
    d = Driver(runner)
    d.start("a", tokens[:PROMPT])
    got = [d.step({"a": PROMPT})["a"]]
    for t in tokens[PROMPT:]:  # the same tokens as the reference
        d.append("a", t)
        got.append(d.step({"a": 1})["a"])
    return got


def one_ulp_noise(model, tokens, ref) -> float:
    """max |logits - ref| when every MoE layer's routed-expert output is moved by one float32 ulp (away from
    zero): the model's own sensitivity to a single rounding difference per layer, the scale below which
    no program that sums in another order can be held."""
    import jax.numpy as jnp
    from flax import nnx

    from dsv41.layers.moe import MoE

    def nudged(experts, x, sel, w):
        y = experts(x, sel, w)
        return jnp.nextafter(y, jnp.where(y >= 0, jnp.inf, -jnp.inf))

    moes = [m for _, m in nnx.iter_modules(model.module) if isinstance(m, MoE)]
    try:
        for m in moes:
            m.routed_compute = nudged
        model.refresh()  # the hook is part of the graph definition
        return float(np.abs(model.logits(np.array(tokens)) - ref).max())
    finally:
        for m in moes:
            m.routed_compute = None
        model.refresh()


def dp_batches_check(model, sm, rc, runner=None) -> dict:
    """Requests of different lengths on different data-parallel ranks (two on the last rank, none on some),
    prefilled in one step and decoded together: each request's logits are its own single-device ones, and the
    KV cache holds rows only in the (rank, slot) pairs of the requests (each rank holds only its requests' KV).
    `runner`: this layout's decode-check runner, reused (no second compile of the same steps), else a new one."""
    from serving.runtime.runner import Runner
    from sharding.runtime import MeshPlacement
    from tests.full_logits import full_logits
    from tests.serving.driver import Driver

    if runner is None:
        runner = Runner(sm, rc, progress=False, placement=MeshPlacement(sm.mesh))
    else:  # the decode check's runner, its steps already compiled: a cache of zeros, as a new runner has
        runner.cache = runner.fresh_cache()
    ranks = runner.ranks
    runner.compiler.precompile([Program.SEGMENT1.at(PROMPT), Program.SEGMENT2.at(PROMPT)])  # the one bucket: the 3-row decode steps pad to it
    rng = np.random.default_rng(5)
    reqs = {"a": (0, 11), "b": (ranks - 1, 16), "c": (ranks - 1, 5)}  # name -> (rank, prompt length)
    tokens = {n: [int(t) for t in rng.integers(3, model.config.vocab_size - 1, L + DECODE)]
              for n, (_, L) in reqs.items()}
    d = Driver(runner)
    for n, (rank, L) in reqs.items():
        d.start(n, tokens[n][:L], rank=rank)
    got = {n: [v] for n, v in d.step({n: L for n, (_, L) in reqs.items() if n != "c"}).items()}
    got["c"] = [d.step({"c": 5})["c"]]  # a prefill alone on a rank while the others idle
    for i in range(DECODE):
        for n, (_, L) in reqs.items():
            d.append(n, tokens[n][L + i])
        for n, v in d.step({n: 1 for n in reqs}).items():
            got[n].append(v)
    err = {}
    for n, (_, L) in reqs.items():  # the references at the single-request check's length: no new length compiled
        ref = full_logits(model, tokens[n], length=PROMPT + DECODE)[L - 1:]
        err[n] = float(np.abs(np.stack(got[n]) - ref).max())
    swa = np.asarray(runner.cache.swa[0]).reshape(ranks, rc.max_num_seqs, -1)
    written = sorted((int(r), int(s)) for r, s in zip(*np.nonzero(np.abs(swa).max(axis=-1))))
    held = sorted((d.reqs[n].rank, d.reqs[n].slot) for n in reqs)
    return {"max_abs_err": err, "ranks": ranks, "kv_written_rank_slot": written, "requests_rank_slot": held}


def release_model(model):
    """`model` written as a quantized release checkpoint and loaded back with its weights in FP8 / MXFP4."""
    import tempfile

    import dsv41
    from dsv41.checkpoint import save_checkpoint

    folder = tempfile.TemporaryDirectory(prefix="dsv41-release-")  # the model maps its files: removed at exit
    _RELEASE_FOLDERS.append(folder)
    save_checkpoint(folder.name, model.config, {p: np.asarray(v) for p, v in model.params.items()}, quantize=True)
    return dsv41.load(folder.name)


def shard_bytes_check(sm) -> dict:
    """Tensors still in FP8 / MXFP4 on the mesh: every device holds exactly the bytes of the index range its
    sharding assigns it, in the stored dtype; and the largest per-device total of them."""
    import ml_dtypes

    stored = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(np.uint8))
    quantized = [p for p, a in sm.params.items() if p[:-1] in sm.base.formats and np.dtype(a.dtype) in stored]
    per_device: dict = {}
    ok = True
    for p in quantized:
        a, host = sm.params[p], np.asarray(sm.base.params[p])
        for shard in a.addressable_shards:
            ok &= shard.data.nbytes == host[shard.index].nbytes and shard.data.dtype == host.dtype
            per_device[shard.device.id] = per_device.get(shard.device.id, 0) + shard.data.nbytes
    return {"each_device_holds_its_shard": bool(ok), "quantized_tensors": len(quantized),
            "max_device_bytes": max(per_device.values()),
            "unsharded_bytes": sum(sm.base.params[p].nbytes for p in quantized)}


def eplb_check(model, tokens, ref) -> dict:
    """DEP8 with one redundant slot per rank: a skewed placement, then a migration to another one between
    calls (same shapes: no recompilation); the logits stay the single-device ones."""
    from sharding.eplb import rebalance
    from sharding.mesh import ParallelConfig
    from sharding.model import ShardedModel

    c = model.config
    layers, E = c.num_hidden_layers, c.n_routed_experts
    sm = ShardedModel(model, ParallelConfig(1, 8, True))
    rng = np.random.default_rng(3)
    errs = []
    for _ in range(2):
        load = rng.zipf(1.5, size=(layers, E)).astype(float)
        sm.apply_placement(rebalance(load, 8, E))
        errs.append(float(np.abs(sm.logits(np.array(tokens)) - ref).max()))
    return {"max_abs_err_per_placement": errs, "physical_experts": 2 * E, "compiles": sm.forward_compilations}


if __name__ == "__main__":
    main()
