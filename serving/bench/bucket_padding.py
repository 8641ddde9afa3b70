"""`python -m serving.bench.bucket_padding`: what a step costs padded up to each larger token bucket - the measurement
the default token ladder is chosen by (`serving.runtime.batch.token_ladder`, docs/design/measurements.md).

    python -m serving.bench.bucket_padding [--model PRESET|PATH] [--token-buckets 2,4,8,...] [--output-json F]

The runtime alone (no server) with every bucket of `--token-buckets` compiled (default: the old geometric ladder of
the server's budget, 2/1 ... 512), then for each step shape - a decode of B requests at --context tokens, a prefill
of L tokens of one request - the median of --repeats steps forced onto each bucket that holds it (smaller buckets
hidden from the runner; a prefill's segment 2 keeps its own bucket). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from serving.bench.prefill import slot_chunk
from serving.engine.args import EngineArgs
from serving.model_source import ModelArgs, load_model
from serving.runtime.programs import Program
from serving.runtime.runner import Runner


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m serving.bench.bucket_padding", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a preset or checkpoint folder (default: the built-in model)")
    p.add_argument("--token-buckets", default="2,4,8,16,32,64,128,256,384,512")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--decode-batches", default="1,2,4,8,16,32")
    p.add_argument("--prefill-lengths", default="64,128,256,384,512")
    p.add_argument("--context", type=int, default=400, help="tokens each decoding request holds")
    p.add_argument("--max-decode-bucket", type=int, default=128, help="decode steps are timed up to this bucket")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--output-json", default=None)
    return p


def measure(args) -> dict:
    buckets = tuple(int(b) for b in args.token_buckets.split(","))
    if args.context > max(buckets):
        raise SystemExit(f"--context {args.context} must fit the largest bucket {max(buckets)} (one prefill step each)")
    ea = EngineArgs.of(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=max(buckets), token_buckets=buckets,
                       max_model_len=max(max(buckets), args.context + 64))
    src = load_model(ModelArgs(model=args.model), 0)
    r = Runner(src.model, ea.runtime, progress=False)
    compiler = r.compiler
    compiler.precompile()
    every = dict(compiler._exe)
    sizes = r.buckets.tokens

    def forced(bucket: int, programs: tuple[Program, ...]) -> None:
        """Only buckets >= `bucket` of `programs` (and every other program) visible to the runner's fit."""
        compiler._exe = {k: v for k, v in every.items() if k.size >= bucket or k.program not in programs}

    def median_seconds(step) -> float:
        step()
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    vocab, rng = src.model.config.vocab_size, np.random.default_rng(0)
    seqs = [[int(x) for x in rng.integers(3, vocab, args.context)] for _ in range(args.max_num_seqs)]
    compiler._exe = every
    for s, tokens in enumerate(seqs):
        r.step([slot_chunk(r, s, tokens, 0, args.context, True)], [None])
    decode, prefill = {}, {}
    for B in (int(b) for b in args.decode_batches.split(",")):
        for b in (b for b in sizes if B <= b <= args.max_decode_bucket):
            forced(b, (Program.SEGMENT1, Program.SEGMENT2))
            chunks = [slot_chunk(r, s, seqs[s], args.context - 1, args.context, True) for s in range(B)]
            decode[f"{B}@{b}"] = median_seconds(lambda: r.step(chunks, [None] * B))
    for L in (int(n) for n in args.prefill_lengths.split(",")):
        tokens = [int(x) for x in rng.integers(3, vocab, L)]
        for b in (b for b in sizes if b >= L):
            forced(b, (Program.SEGMENT1,))
            prefill[f"{L}@{b}"] = median_seconds(lambda: r.step([slot_chunk(r, 0, tokens, 0, L, True)], [None]))
    compiler._exe = every
    return {"model": args.model or "(built-in)", "dtype": src.model.dtype.name, "buckets": list(sizes),
            "context": args.context, "decode_s": decode, "prefill_s": prefill}


def format_table(result: dict) -> str:
    lines = [f"model {result['model']} ({result['dtype']}), buckets {result['buckets']}; ms per step"]
    for kind, label in (("decode_s", "decode rows"), ("prefill_s", "prefill tokens")):
        cells = {tuple(int(x) for x in k.split("@")): v for k, v in result[kind].items()}
        cols = sorted({b for _, b in cells})
        lines.append(f"{label:>15} | " + " ".join(f"{b:>7}" for b in cols))
        for n in sorted({n for n, _ in cells}):
            lines.append(f"{n:>15} | " + " ".join(f"{cells[n, b] * 1e3:7.2f}" if (n, b) in cells else " " * 7
                                                 for b in cols))
    return "\n".join(lines)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    result = measure(args)
    print(format_table(result))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.output_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
