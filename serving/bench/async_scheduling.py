"""`python -m serving.bench.async_scheduling`: the engine's decode step with async scheduling against one step at a
time, side by side in one process, on the same weights.

Two engines share the model (each its own KV cache and compiled programs): `--async-scheduling` and
`--no-async-scheduling`. A round gives one engine `batch` greedy requests of `--context` random prompt tokens and
`--steps` forced output tokens (`ignore_eos`) and steps it until they finish; the time per decode step is taken over
the window in which every request decodes (from the step that gave the last first token to the one before the first
finish), so prefills and the drain are left out. The engines alternate round by round (a shared machine drifts
10-30% within minutes) and every round checks that both emit the same greedy tokens: async scheduling changes when
the host learns a token, never which token. Per batch: the median ms per step of each mode and async / step by
step (below 1: async is faster). Prints a table, writes JSON.

Async scheduling needs a V4.1 model's Engram tables on the device (with tables in host memory the host gathers
their rows, so steps go one at a time): a checkpoint's are loaded as device arrays here, whatever the backend.

    python -m serving.bench.async_scheduling [--model small] [--batches 1,8,32] [--context 256] [--steps 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

MODES = ("async", "step")  # engine.async_scheduling on / off


def engines(model, a: argparse.Namespace) -> dict:
    """Both engines, each with its programs compiled (or loaded from `--compilation-cache-dir`)."""
    from serving.engine.args import EngineArgs
    from serving.engine.engine import Engine

    B = max(a.batches)
    base = EngineArgs.of(max_num_seqs=B, max_num_batched_tokens=max(a.max_num_batched_tokens, B),
                         max_model_len=a.context + a.steps + 8, block_size=a.block_size,
                         token_buckets=tuple(sorted({*a.batches, a.max_num_batched_tokens})),
                         kernel_impl=a.kernel_impl)
    out = {}
    for mode in MODES:
        e = Engine(model, None, base.replace(async_scheduling=mode == "async"), progress=False)
        if (mode == "async") != e.async_scheduling:
            raise SystemExit(f"this model cannot be scheduled async: {e.scheduling_summary()}")
        out[mode] = e
    return out


def decode_round(engine, batch: int, context: int, steps: int, vocab: int, seed: int) -> dict:
    """One round: ms per step over the window in which all `batch` requests decode, and each request's tokens."""
    from serving.runtime.sampling_params import SamplingParams

    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    ids = [f"r{seed}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, [int(t) for t in rng.integers(3, vocab, context)], params)
    tokens = {rid: [] for rid in ids}
    stamps = []  # (time after the step, requests with a token, any request finished)
    while engine.has_unfinished():
        outs = engine.step()
        for o in outs:
            tokens[o.request_id] += o.new_token_ids
        stamps.append((time.perf_counter(), sum(bool(t) for t in tokens.values()), any(o.finished for o in outs)))
    first = next(i for i, (_, started, _) in enumerate(stamps) if started == batch)
    last = next(i for i, (_, _, done) in enumerate(stamps) if done) - 1
    if last - first < 2:
        raise SystemExit(f"batch {batch}: {last - first} steps in the decode window; raise --steps")
    ms = 1000 * (stamps[last][0] - stamps[first][0]) / (last - first)
    return {"step_ms": ms, "window_steps": last - first, "tokens": [tokens[r] for r in ids]}


def run(model, a: argparse.Namespace) -> dict:
    es = engines(model, a)
    vocab = model.config.vocab_size
    res = {"model": a.model, "dtype": a.dtype, "context": a.context, "steps": a.steps, "repeats": a.repeats,
           "batches": {}}
    for B in a.batches:
        for e in es.values():  # warm-up: the decode programs' first runs, allocators
            decode_round(e, B, a.context, a.steps, vocab, seed=0)
        rounds = []
        for i in range(a.repeats):
            order = MODES if i % 2 == 0 else MODES[::-1]
            got = {m: decode_round(es[m], B, a.context, a.steps, vocab, seed=1 + i) for m in order}
            same = got["async"]["tokens"] == got["step"]["tokens"]
            if not same:
                raise SystemExit(f"batch {B}, round {i + 1}: async scheduling emitted other greedy tokens than one "
                                 "step at a time")
            rounds.append({m: {"step_ms": got[m]["step_ms"], "window_steps": got[m]["window_steps"]} for m in MODES})
            print(f"batch {B} round {i + 1}: async {got['async']['step_ms']:.2f} ms/step, "
                  f"step by step {got['step']['step_ms']:.2f}", file=sys.stderr)
        med = {m: statistics.median(r[m]["step_ms"] for r in rounds) for m in MODES}
        res["batches"][str(B)] = {"async_ms": med["async"], "step_ms": med["step"],
                                  "async_over_step": med["async"] / med["step"], "same_tokens": True,
                                  "rounds": rounds}
    return res


def print_table(res: dict) -> None:
    print(f"decode step, {res['model']} ({res['dtype']}), context {res['context']}, medians of {res['repeats']} "
          "alternated rounds; the same greedy tokens in every round")
    print(f"{'batch':>6} {'async ms':>9} {'step ms':>9} {'async/step':>11}")
    for B, r in res["batches"].items():
        print(f"{B:>6} {r['async_ms']:9.2f} {r['step_ms']:9.2f} {r['async_over_step']:11.3f}")


def main(argv=None) -> int:
    from pallas_kernels import IMPLS

    ap = argparse.ArgumentParser(prog="python -m serving.bench.async_scheduling", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small", help="preset or checkpoint folder (default: small, random weights)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=32, help="output tokens per request")
    ap.add_argument("--repeats", type=int, default=4, help="alternated rounds per mode (default: 4)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--kernel-impl", default="auto", choices=IMPLS)
    ap.add_argument("--compilation-cache-dir", default="", help="JAX's persistent compilation cache (default: off)")
    ap.add_argument("--out", default="bench_async_scheduling.json")
    a = ap.parse_args(argv)
    a.batches = sorted({int(x) for x in a.batches.split(",") if x})
    import dsv41
    from serving.runtime.compiler import enable_compilation_cache

    enable_compilation_cache(a.compilation_cache_dir or None)
    model = (dsv41.random_model(a.model, dtype=a.dtype) if a.model in dsv41.PRESETS
             else dsv41.load(a.model, dtype=a.dtype, engram_cpu_offload=False))
    res = run(model, a)
    print_table(res)
    Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
