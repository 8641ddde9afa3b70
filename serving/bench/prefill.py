"""`python -m serving.bench.prefill`: prefill wall time with CED decoder replay off and on, and decode
throughput, on the `small` config (or any preset / checkpoint) - the runtime alone, no server.

For each prompt length, a fresh request (no prefix cache) is prefilled in one step; the time runs from
submitting the step to having the last row's logits on the host, compilation excluded (every bucket of both modes
is precompiled first), median of `--repeats` runs after one warm-up, the two modes alternating run by run (`alternate`:
run one after the other, the first ran 13-28% slower). Decode: `batch` requests with
`--decode-context` tokens each decode `--decode-steps` tokens together. Prints a table, writes JSON.

Against this machine's roofline (`serving.bench.roofline`): before each timed prefill a matmul probe (`--dtype`),
before each decode step a streaming probe, so each run is compared with the rate of the same moment (the speed
of a shared machine drifts 10-30% within minutes). A prefill's fraction = its FLOPs at the probed matmul rate /
its time; a decode step's ratio = its time / its weight bytes at the probed streaming rate; medians of the runs.
`--profile-dir DIR`: a `jax.profiler` trace of each measurement (one session folder each, named after it): each
prefill mode's runs again after its timed rounds (a trace slows the runs it records), and the decode steps again after
theirs, from the same context, without the probes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np

import dsv41
from pallas_kernels import IMPLS
from serving.bench.roofline import MatmulProbe, RowsDotProbe, StreamProbe, decode_weight_bytes, prefill_flops
from serving.engine.profiler import profiling
from serving.runtime.batch import SeqChunk
from serving.runtime.config import RuntimeConfig
from serving.runtime.kv_cache import FORMATS
from serving.runtime.host_memory import keep_freed_memory_or_say
from serving.runtime.compiler import enable_compilation_cache
from serving.runtime.runner import Runner
from serving.runtime.programs import BucketKey, Program


def slot_chunk(r: Runner, slot: int, tokens: list[int], start: int, end: int, trim: bool) -> SeqChunk:
    """Slot s owns blocks [s * max_blocks, (s + 1) * max_blocks): the default cache has exactly those."""
    first = slot * r.max_blocks
    blocks = list(range(first, first + -(-end // r.layout.block_size)))
    return SeqChunk(slot=slot, block_table=blocks, token_ids=tokens[:end], start=start, end=end, trim=trim)


def _runner(model, args, lengths, bounded: bool) -> Runner:
    top = max(max(lengths), max(args.decode_batches))
    rc = RuntimeConfig(max_num_seqs=max(args.decode_batches), max_num_batched_tokens=top,
                       max_model_len=max(max(lengths), args.decode_context + args.decode_steps + 1),
                       block_size=args.block_size, swa_bounded_replay=bounded,
                       token_buckets=tuple(sorted(set(lengths) | set(args.decode_batches)
                                                  | {args.decode_context, model.config.sliding_window})),
                       kernel_impl=args.kernel_impl, kv_cache_dtype=args.kv_cache_dtype)
    return Runner(model, rc, progress=not args.quiet)


def _keys(r: Runner, lengths, args, decodes: bool) -> list[BucketKey]:
    """The buckets the runner's prefills (and, for the runner that `decodes`, the decode steps and their context's
    prefills) run: nothing else is compiled."""
    keys = set()
    for L in list(lengths) + ([args.decode_context] if decodes else []):
        K = r.buckets.token_bucket(min(L, _decoder_rows(r) or L))
        keys |= {Program.SEGMENT1.at(L), Program.SEGMENT2.at(K), Program.SAMPLE.at(r.buckets.requests(K))}
    for B in args.decode_batches if decodes else []:
        T = r.buckets.token_bucket(B)
        keys |= {Program.SEGMENT1.at(T), Program.SEGMENT2.at(T), Program.SAMPLE.at(r.buckets.requests(T))}
    return sorted(keys, key=lambda k: (k.program.value, k.size))


def prefill_run(r: Runner, L: int, bounded: bool, vocab: int) -> Callable[[int], float]:
    """run(i) -> seconds of one L-token prefill of fresh prompt i (no prefix cache): from submitting the step to
    the last row's logits on the host."""
    def run(i: int) -> float:
        tokens = [int(t) for t in np.random.default_rng(i).integers(3, vocab, L)]
        t = time.perf_counter()
        np.asarray(r.forward([slot_chunk(r, 0, tokens, 0, L, bounded)]))
        return time.perf_counter() - t

    return run


def _decoder_rows(r: Runner) -> int | None:
    """The rows of a prefill the layers after the CED cut run on `r` (decoder replay: the last window); None: all."""
    return r.config.sliding_window if r.rc.swa_bounded_replay and r.decoder_replay else None


def mode_flops(r: Runner, L: int) -> float:
    """FLOPs an L-token prefill runs on `r` (`prefill_flops` with its decoder rows)."""
    return prefill_flops(r.config, L, decoder_rows=_decoder_rows(r))


def alternate(runs: dict[str, Callable[[int], float]], repeats: int,
              probe: Callable[[], float] | None = None) -> dict[str, tuple[list[float], list[float]]]:
    """{name: (seconds of `repeats` runs, rates probed right before each; none without `probe`)}: every run once to
    warm caches and allocators, then `repeats` rounds of one run each in turn. Measured one after the other in one
    process, the same program ran 13-28% slower first than second in four runs (replay off and on compile to one
    program for a model without a CED cut: 0.190 / 0.149 s in a row, 0.149 / 0.147 s alternated)."""
    for run in runs.values():
        run(0)
    out = {name: ([], []) for name in runs}
    for i in range(1, repeats + 1):
        for name, run in runs.items():
            if probe:
                out[name][1].append(probe())
            out[name][0].append(run(i))
    return out


def bench_decode(r: Runner, B: int, context: int, steps: int, vocab: int, profile_dir: str | None = None,
                 label: str = "", probes: Sequence[Callable[[], float]] = ()) -> tuple[list[float], list[list[float]]]:
    """(step seconds, per probe its rates taken right before each step) of `steps` decode steps of B requests; with
    `profile_dir`, the same steps again after the timed ones, traced without the probes (a trace slows the steps it
    records, and a probe's ops in it would be counted as the step's)."""
    seqs = [[int(t) for t in np.random.default_rng(100 + s).integers(3, vocab, context)] for s in range(B)]

    def prefill() -> None:
        for s in range(B):
            del seqs[s][context:]
            np.asarray(r.forward([slot_chunk(r, s, seqs[s], 0, context, True)]))

    prefill()

    def step() -> float:
        chunks = []
        for s in range(B):
            seqs[s].append(7)
            n = len(seqs[s])
            chunks.append(slot_chunk(r, s, seqs[s], n - 1, n, True))
        t = time.perf_counter()
        np.asarray(r.step(chunks, [None] * B).tokens)
        return time.perf_counter() - t

    step()  # the first step warms caches and allocators
    times, rates = [], [[] for _ in probes]
    for _ in range(steps):
        for probe, out in zip(probes, rates):
            out.append(probe())
        times.append(step())
    if profile_dir:
        prefill()
        with profiling(profile_dir, label):
            for _ in range(steps):
                step()
    return times, rates


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serving.bench.prefill", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small", help="preset or checkpoint folder (default: small, random weights)")
    ap.add_argument("--lengths", default="1024,2048,4096,8192")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--decode-batches", default="1,8,32")
    ap.add_argument("--decode-context", type=int, default=1024)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="compute dtype (the full-size presets, e.g. v41-flash-slice, get release-format random "
                         "weights: FP8 linears, MXFP4 experts)")
    ap.add_argument("--weights", default="release", choices=("release", "dequantize"),
                    help="a checkpoint's FP8 / MXFP4 weights kept in their formats (decoded by the ops) or decoded "
                         "at load")
    ap.add_argument("--kernel-impl", default="auto", choices=IMPLS,
                    help="the fused ops' implementation (auto: Pallas on a GPU, XLA elsewhere)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=FORMATS,
                    help="the KV records (auto: the compute dtype; release: FP8 SWA / NVFP4 global / MXFP4 indexer)")
    ap.add_argument("--compilation-cache-dir", default="",
                    help="JAX's persistent compile cache: a program both runners share compiles once")
    ap.add_argument("--out", default="bench_prefill.json")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--profile-dir", default=None, help="write a jax.profiler trace of each measurement here")
    args = ap.parse_args(argv)
    keep_freed_memory_or_say()
    enable_compilation_cache(args.compilation_cache_dir)
    args.decode_batches = [int(x) for x in args.decode_batches.split(",")]
    lengths = [int(x) for x in args.lengths.split(",")]
    model = (dsv41.random_model(args.model, dtype=args.dtype) if args.model in dsv41.PRESETS
             else dsv41.load(args.model, dtype=args.dtype, weights=args.weights))
    vocab = model.config.vocab_size
    matmul, stream = MatmulProbe(args.dtype), StreamProbe()
    result = {"model": args.model, "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype, "repeats": args.repeats,
              "prefill": {}, "decode": {},
              "compile_seconds": {}}
    runners = {}
    for bounded in (False, True):
        mode = "replay_on" if bounded else "replay_off"
        runners[mode] = r = _runner(model, args, lengths, bounded)
        result["compile_seconds"][mode] = round(r.compiler.precompile(_keys(r, lengths, args, decodes=bounded)), 1)
    for L in lengths:
        runs = {mode: prefill_run(r, L, mode == "replay_on", vocab) for mode, r in runners.items()}
        for mode, (times, rates) in alternate(runs, args.repeats, matmul).items():
            flops = mode_flops(runners[mode], L)
            result["prefill"].setdefault(str(L), {"gflop": prefill_flops(model.config, L) / 1e9})[mode] = {
                "median_s": statistics.median(times), "runs_s": times, "matmul_flop_s": rates, "gflop_run": flops / 1e9,
                "of_matmul_roofline": statistics.median(flops / f / t for f, t in zip(rates, times))}
        if args.profile_dir:  # after the timed rounds: a trace slows the runs it records
            for mode, run in runs.items():
                with profiling(args.profile_dir, f"prefill_{L}_{mode}"):
                    for i in range(1, args.repeats + 1):
                        run(i)
    r = runners["replay_on"]
    del runners, runs  # the replay-off runner's cache and programs go before the decode steps
    for B in args.decode_batches:
        rows = RowsDotProbe(r.buckets.token_bucket(B), args.dtype)
        times, (rates, dot_rates) = bench_decode(r, B, args.decode_context, args.decode_steps, vocab,
                                                 args.profile_dir, f"decode_batch{B}", (stream, rows))
        nbytes = decode_weight_bytes(model, B)
        result["decode"][str(B)] = {
            "step_s": statistics.median(times), "tokens_per_s": B / statistics.median(times),
            "runs_s": times, "stream_bytes_s": rates, "weight_bytes_per_step": nbytes,
            "weight_read_floor_s": nbytes / statistics.median(rates),
            "step_over_floor": statistics.median(t * f / nbytes for f, t in zip(rates, times)),
            "dot_rows": rows.rows, "dot_bytes_s": dot_rates, "dot_floor_s": nbytes / statistics.median(dot_rates),
            "step_over_dot_floor": statistics.median(t * f / nbytes for f, t in zip(dot_rates, times))}
    lines = [f"prefill, {args.model} ({args.dtype}, KV {args.kv_cache_dtype}), median of {args.repeats} after warm-up, "
             f"replay off and on alternated run by run, compile excluded; "
             f"roofline = the FLOPs the mode runs (replay on: the layers after the CED cut on the last window "
             f"rows) at the {args.dtype} matmul rate probed before each run",
             f"{'tokens':>7} {'GFLOP':>7} {'replay off (s)':>15} {'of roofline':>12} {'GFLOP on':>9} "
             f"{'replay on (s)':>14} {'of roofline':>12} {'on/off':>7}"]
    for L in lengths:
        p = result["prefill"][str(L)]
        off, on = p["replay_off"], p["replay_on"]
        p["ratio"] = on["median_s"] / off["median_s"]
        lines.append(f"{L:>7} {p['gflop']:>7.1f} {off['median_s']:>15.3f} {off['of_matmul_roofline']:>12.1%} "
                     f"{on['gflop_run']:>9.1f} {on['median_s']:>14.3f} {on['of_matmul_roofline']:>12.1%} "
                     f"{p['ratio']:>7.2f}")
    lines += ["", (f"decode, context {args.decode_context}; floor = the step's weight bytes at the streaming rate "
                   f"probed before each step; dot floor = the same bytes at the rate the {args.dtype} matmul reads "
                   f"weights in a product of the step's rows, probed likewise"),
              f"{'batch':>7} {'tokens/s':>10} {'step ms':>9} {'weights MB':>11} {'GB/s':>6} {'floor ms':>9} "
              f"{'step/floor':>11} {'rows':>5} {'dot GB/s':>9} {'dot floor ms':>13} {'step/dot floor':>15}"]
    for B in args.decode_batches:
        d = result["decode"][str(B)]
        lines.append(f"{B:>7} {d['tokens_per_s']:>10.1f} {d['step_s'] * 1e3:>9.2f} "
                     f"{d['weight_bytes_per_step'] / 1e6:>11.1f} {statistics.median(d['stream_bytes_s']) / 1e9:>6.0f} "
                     f"{d['weight_read_floor_s'] * 1e3:>9.3f} {d['step_over_floor']:>11.1f} {d['dot_rows']:>5} "
                     f"{statistics.median(d['dot_bytes_s']) / 1e9:>9.1f} {d['dot_floor_s'] * 1e3:>13.3f} "
                     f"{d['step_over_dot_floor']:>15.1f}")
    print("\n".join(lines))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
