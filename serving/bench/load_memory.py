"""Host memory while loading a quantized checkpoint straight onto a mesh: a synthetic release-format checkpoint
(small's architecture with `--experts` x `--moe-intermediate` MXFP4 experts, random bytes) is written once, then
loaded in a fresh process on `--devices` virtual CPU devices with `dsv41.load(..., shardings=)`, each device
receiving only its shard of each tensor from the memory-mapped files.

Measured in the loading process: anonymous resident memory (RssAnon, sampled every millisecond) above the
baseline before the load; `peak_overhead` = its peak minus what the loaded arrays hold at the end (on CPU
devices the parameters are host memory too), compared with the largest tensor as loaded (the one read and
decoded at a time). Also: whether every device holds exactly the bytes of its index range of each tensor.

    python -m serving.bench.load_memory --experts 384 --out bench_load_memory.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = {"dep8": (1, 8, True), "tp2dep4": (2, 4, True), "tp8": (8, 1, False)}


def synthetic_config(experts: int, moe_intermediate: int):
    import dsv41

    c = dsv41.load_config("small")
    return c.replace(n_routed_experts=experts, moe_intermediate_size=moe_intermediate,
                     quantization={"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                                   "scale_fmt": "ue8m0", "expert_dtype": "fp4"})


def write_synthetic_checkpoint(folder: Path, c, shard_bytes: int = 1 << 30, seed: int = 0) -> int:
    """Random tensors in the release formats of `c` (FP8 linears, MXFP4 experts, FP8 Engram tables, BF16 and
    F32 elsewhere): the tensors `export_tensors(quantize=True)` would write, without a float model. Returns the
    bytes written."""
    import jax.numpy as jnp
    import ml_dtypes

    from dsv41 import checkpoint
    from dsv41.api import abstract_params
    from dsv41.safetensors_io import write_checkpoint

    _, dense = abstract_params(c, jnp.bfloat16, engram_fp8=True)
    _, abstract = abstract_params(c, jnp.bfloat16, True, checkpoint.release_formats(c, list(dense)))
    rng = np.random.default_rng(seed)
    tensors, e8m0 = {}, set()
    for name, t in checkpoint.release_names(c, list(abstract)).items():
        spec = abstract[t.path]
        shape = spec.shape[1:] if t.expert is not None else spec.shape
        dt = np.dtype(spec.dtype)
        if name.endswith(".scale") and dt == np.uint8:
            tensors[name] = rng.integers(118, 124, shape, dtype=np.uint8)
            e8m0.add(name)
        elif dt == np.uint8:  # packed MXFP4 expert bytes
            tensors[name] = rng.integers(0, 256, shape, dtype=np.uint8).view(np.int8)
        elif dt == np.dtype(ml_dtypes.float8_e4m3fn):
            tensors[name] = rng.integers(0, 0x7F, shape, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
        elif np.issubdtype(dt, np.integer):
            tensors[name] = rng.integers(0, c.n_routed_experts, shape).astype(dt)
        else:
            out = np.float32 if dt == np.float32 else ml_dtypes.bfloat16
            tensors[name] = (0.02 * rng.standard_normal(shape, dtype=np.float32)).astype(out)
    write_checkpoint(folder, tensors, e8m0, shard_bytes)
    cfg = c.replace(quantization=checkpoint.release_quantization(c))
    (folder / "config.json").write_text(json.dumps(cfg.to_release_dict(), indent=1))
    return sum(a.nbytes for a in tensors.values())


def _rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


def measure(folder: str, layout: str, dtype: str) -> dict:
    """In this process (started with the virtual devices): load `folder` onto the layout's mesh."""
    import jax

    import dsv41
    from dsv41.safetensors_io import open_checkpoint
    from sharding.mesh import ParallelConfig, make_mesh
    from sharding.rules import param_sharding_fn

    tp, dp, ep = LAYOUTS[layout]
    mesh = make_mesh(ParallelConfig(tp, dp, ep))
    jax.numpy.zeros(1).block_until_ready()  # backends up before the baseline
    baseline = _rss_anon()
    peak, done = [baseline], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_anon())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    model = dsv41.load(folder, dtype=dtype, shardings=param_sharding_fn(mesh), engram_cpu_offload=True)
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    final = _rss_anon()
    peak[0] = max(peak[0], final)
    held = sum(s.data.nbytes for a in model.params.values() for s in a.addressable_shards)
    own = all(s.data.nbytes == np.empty(a.shape, a.dtype)[s.index].nbytes and s.data.shape == np.empty(
        a.shape, a.dtype)[s.index].shape for a in model.params.values() for s in a.addressable_shards)
    # what one read holds: a whole tensor (decoded once, then sliced per device), or one device's block of an
    # expert stack (each device's experts read on their own)
    experts = {"w1", "w2", "w3", "w1_scale", "w2_scale", "w3_scale"}
    largest = max(max(s.data.nbytes for s in a.addressable_shards) if p[-1] in experts else a.nbytes
                  for p, a in model.params.items())
    stored = max(e.nbytes for e in open_checkpoint(folder).values() if ".engram.embed." not in e.name)
    return {"layout": layout, "dtype": dtype, "devices": jax.device_count(), "load_seconds": round(seconds, 2),
            "baseline_anon_bytes": baseline, "peak_anon_above_baseline": peak[0] - baseline,
            "final_anon_above_baseline": final - baseline, "param_bytes_held_by_devices": held,
            "peak_overhead": peak[0] - final, "largest_tensor_loaded": largest, "largest_tensor_stored": stored,
            "each_device_holds_its_shard": bool(own),
            "engram_tables_host_bytes": model.engram_tables.nbytes if model.engram_tables else 0}


def run_measure(folder: Path, layout: str, dtype: str, devices: int = 8) -> dict:
    """`measure` in a fresh process on `devices` virtual CPU devices -> its JSON."""
    import os

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    proc = subprocess.run([sys.executable, "-m", "serving.bench.load_memory", "--measure", str(folder),
                           "--layout", layout, "--dtype", dtype], cwd=ROOT, env=env, capture_output=True, text=True,
                          check=False)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serving.bench.load_memory", description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument("--moe-intermediate", type=int, default=1024)
    ap.add_argument("--layout", default="dep8", choices=tuple(LAYOUTS))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--folder", default=None, help="write the synthetic checkpoint here (default: a temporary folder)")
    ap.add_argument("--out", default="bench_load_memory.json")
    ap.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # the measuring subprocess
    a = ap.parse_args(argv)
    if a.measure:
        print(json.dumps(measure(a.measure, a.layout, a.dtype)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(a.folder or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        written = write_synthetic_checkpoint(folder, synthetic_config(a.experts, a.moe_intermediate))
        write_s = time.perf_counter() - t0
        r = run_measure(folder, a.layout, a.dtype)
    r.update(checkpoint_bytes=written, write_seconds=round(write_s, 1), experts=a.experts,
             moe_intermediate=a.moe_intermediate)
    gib = 2**30
    print("| checkpoint | layout | load s | peak anon above baseline | held by devices | peak overhead | "
          "largest tensor | overhead / largest | each device its shard |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {written / gib:.2f} GiB | {r['layout']} x{r['devices']} | {r['load_seconds']} | "
          f"{r['peak_anon_above_baseline'] / gib:.2f} GiB | {r['param_bytes_held_by_devices'] / gib:.2f} GiB | "
          f"{r['peak_overhead'] / 2**20:.0f} MiB | {r['largest_tensor_loaded'] / 2**20:.0f} MiB | "
          f"{r['peak_overhead'] / r['largest_tensor_loaded']:.2f} | {r['each_device_holds_its_shard']} |")
    Path(a.out).write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
