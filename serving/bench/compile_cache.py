"""`python -m serving.bench.compile_cache`: what a persistent-cache hit saves on this backend.

A jit of `--layers` unrolled layers ([8, 256] x [256, 256] matmul, tanh, sin, a norm) is compiled in two fresh
processes sharing an empty persistent cache: the first compiles and writes the entry, the second loads it
(the cache hit is checked in JAX's log, not assumed). Prints both compile wall times per size and writes JSON.
On XLA:CPU (jaxlib 0.12) a hit costs about as much as compiling once the program is large, which is why a warm
server start only gets shorter with smaller programs.

    python -m serving.bench.compile_cache [--layers 200,1000] [--out bench_compile_cache.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, logging, sys, time, io
import jax, jax.numpy as jnp
log = io.StringIO()
logging.getLogger("jax._src.compiler").addHandler(logging.StreamHandler(log))
logging.getLogger("jax._src.compiler").setLevel(logging.DEBUG)
cache_dir, layers = sys.argv[1], int(sys.argv[2])
jax.config.update("jax_compilation_cache_dir", cache_dir)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

def f(x, ws):
    for w in ws:
        x = jnp.tanh(x @ w) + jnp.sin(x)
        x = x / (1 + jnp.sum(x * x, -1, keepdims=True))
    return x

ws = [jax.ShapeDtypeStruct((256, 256), jnp.float32)] * layers
lowered = jax.jit(f).lower(jax.ShapeDtypeStruct((8, 256), jnp.float32), ws)
t = time.perf_counter()
lowered.compile()
seconds = time.perf_counter() - t
print(json.dumps({"compile_s": seconds, "cache_hit": "Persistent compilation cache hit for 'jit_f'" in log.getvalue()}))
"""


def measure(layers: int) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        runs = [json.loads(subprocess.run([sys.executable, "-c", _CHILD, cache, str(layers)], check=True,
                                          capture_output=True, text=True).stdout.splitlines()[-1])
                for _ in range(2)]
    if runs[0]["cache_hit"] or not runs[1]["cache_hit"]:
        raise RuntimeError(f"{layers} layers: expected a miss then a hit, got {runs}")
    return {"layers": layers, "cold_s": runs[0]["compile_s"], "cache_hit_s": runs[1]["compile_s"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serving.bench.compile_cache", description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="200,1000", help="program sizes, comma-separated (default: 200,1000)")
    ap.add_argument("--out", default="bench_compile_cache.json")
    args = ap.parse_args(argv)
    rows = [measure(int(n)) for n in args.layers.split(",")]
    print(f"{'layers':>7} {'cold s':>8} {'hit s':>8} {'hit/cold':>9}")
    for r in rows:
        print(f"{r['layers']:>7} {r['cold_s']:>8.2f} {r['cache_hit_s']:>8.2f} {r['cache_hit_s'] / r['cold_s']:>9.2f}")
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
