"""`python -m serving.bench.budget_steps`: what the step budget does to the runner's own steps, without a server.

One runner per budget (`--budgets`, default flags otherwise), all in one process, every program compiled first; then
`--rounds` rounds, the budgets' order alternating: a prompt of `--prompt-len` tokens prefilled in budget-sized
chunks (seconds), and `--decode-steps` decode steps of one request at that context (median ms a step). Medians of
the rounds. `serving.bench.defaults` measures the budgets through the server (scheduling, HTTP, clients); this
separates what the compiled steps cost from what the scheduling does with them.

    python -m serving.bench.budget_steps [--model PEER_DIR/tiny-v4] [--budgets 512,1024] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from serving.api.server import ServerArgs


def _runner(model, budget: int):
    from serving.engine.args import EngineArgs
    from serving.runtime.runner import Runner

    r = Runner(model, EngineArgs.of(max_num_batched_tokens=budget).runtime, progress=False)
    r.compiler.precompile()
    return r


def _prefill_seconds(r, budget: int, prompt: list[int], slot: int = 0) -> float:
    from serving.bench.prefill import slot_chunk

    t = time.perf_counter()
    for start in range(0, len(prompt), budget):
        np.asarray(r.forward([slot_chunk(r, slot, prompt, start, min(len(prompt), start + budget), True)]))
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m serving.bench.budget_steps", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a checkpoint folder or a preset (random weights; default: the "
                                                  "built-in nano-austen)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--budgets", default="512,1024")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--decode-context", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--compilation-cache-dir", default=ServerArgs.compilation_cache_dir)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    import dsv41
    from dsv41 import nano
    from serving.bench.prefill import bench_decode
    from serving.runtime.compiler import enable_compilation_cache

    enable_compilation_cache(args.compilation_cache_dir)
    model = (dsv41.random_model(args.model, dtype=args.dtype) if args.model in dsv41.PRESETS
             else dsv41.load(args.model or nano.NANO_DIR, dtype=args.dtype))
    budgets = [int(b) for b in args.budgets.split(",")]
    runners = {b: _runner(model, b) for b in budgets}
    prefill = {b: [] for b in budgets}
    decode = {b: [] for b in budgets}
    for round_ in range(args.rounds):
        for b in budgets if round_ % 2 == 0 else budgets[::-1]:
            prompt = [int(t) for t in np.random.default_rng(round_).integers(3, model.config.vocab_size,
                                                                              args.prompt_len)]
            prefill[b].append(_prefill_seconds(runners[b], b, prompt))
            times, _ = bench_decode(runners[b], 1, args.decode_context, args.decode_steps, model.config.vocab_size)
            decode[b].append(1000 * statistics.median(times))
    rows = [{"budget": b, "prefill_s": statistics.median(prefill[b]), "decode_ms": statistics.median(decode[b]),
             "rounds": {"prefill_s": prefill[b], "decode_ms": decode[b]}} for b in budgets]
    print(f"\n| budget | prefill of {args.prompt_len} tokens (s) | decode, 1 request at {args.decode_context} (ms) |")
    print("|---|---|---|")
    for row in rows:
        print(f"| {row['budget']} | {row['prefill_s']:.3f} | {row['decode_ms']:.2f} |")
    result = {"model": str(args.model or "nano-austen"), "dtype": args.dtype, "prompt_len": args.prompt_len,
              "decode_context": args.decode_context, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
