"""Served decode throughput vs the bare jitted decode step, side by side in one run.

bare    the runtime alone: `batch` requests prefilled to `context` tokens, then `steps` decode steps of
        `Runner.step` (host batch build + both segments + on-device sampling + the tokens' copy to the host);
        tokens/s = batch / median step time.
served  `python -m serving.server` with the same engine configuration, `batch` concurrent streaming
        completions of `context` token-id prompts and `steps` forced output tokens; tokens/s counted over
        the window in which every request is decoding (from the last first-token to the first last-token),
        from each chunk's arrival time and token ids - scheduler, detokenizer, SSE and HTTP included.

The two sides alternate, `--repeats` rounds of bare then served with the server kept up (idle while the bare
steps run), and the ratio is that of the two medians: this machine's speed drifts by 10-20% over minutes, which
one bare run followed by one served run mistook for overhead (0.84 to 1.04 on the same code).

`--profile-dir DIR`: a `jax.profiler` trace of the first round - the bare steps in this process (run again after the
timed ones, `prefill.bench_decode`), the served window through the server's `/start_profile` / `/stop_profile` - each
in its own session folder.

    python -m serving.bench.decode_overhead [--model small] [--batch 32] [--context 256] [--steps 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from serving.bench.server_process import REPO_ROOT, free_port, server_process
from serving.runtime.host_memory import keep_freed_memory_or_say

STARTUP_TIMEOUT_S = 1800.0  # the server compiles its steps before /health answers


def _engine_args(args):
    """The engine configuration both sides run (the bare runner takes its runtime section, the server its flags)."""
    from serving.engine.args import EngineArgs

    return EngineArgs.of(max_num_seqs=args.batch, max_num_batched_tokens=args.max_num_batched_tokens,
                         max_model_len=args.context + args.steps + 8, block_size=args.block_size,
                         token_buckets=tuple(sorted({args.batch, args.max_num_batched_tokens})),
                         async_scheduling=args.async_scheduling)


def bare_runner(args):
    import dsv41
    from serving.runtime.compiler import enable_compilation_cache
    from serving.runtime.runner import Runner

    enable_compilation_cache(args.compilation_cache_dir)
    model = (dsv41.random_model(args.model, dtype=args.dtype) if args.model in dsv41.PRESETS
             else dsv41.load(args.model, dtype=args.dtype))
    r = Runner(model, _engine_args(args).runtime, progress=False)
    r.compiler.precompile()
    return r


def bare(args, r, profile: bool) -> float:
    """ms per step of `steps` decode steps of the runner (its requests prefilled again each round)."""
    from serving.bench.prefill import bench_decode

    times, _ = bench_decode(r, args.batch, args.context, args.steps, r.config.vocab_size,
                            args.profile_dir if profile else None, "bare_decode")
    return 1000 * statistics.median(times)


async def _stream(client, url, prompt, steps, log):
    body = {"prompt": prompt, "max_tokens": steps, "temperature": 0, "stream": True, "ignore_eos": True,
            "return_token_ids": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                ch = json.loads(line[6:])
                if ch["choices"]:
                    log.append((time.perf_counter(), len(ch["choices"][0].get("token_ids") or [])))


@contextlib.contextmanager
def server(args):
    """The server with the same engine configuration, ready; yields its URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "serving.server", "--port", str(port), "--disable-access-log", "--log-level",
           "warning", "--compilation-cache-dir", args.compilation_cache_dir, "--dtype", args.dtype,
           "--no-background-compile",  # measured steps must not share the CPU with the other buckets' compiles
           *_engine_args(args).to_flags()]
    if args.model:
        cmd += ["--model", args.model]
    if args.profile_dir:
        cmd += ["--profile-dir", str(Path(args.profile_dir).absolute())]  # the server runs in another folder
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    with server_process(cmd, port, None, STARTUP_TIMEOUT_S, env) as url:
        yield url


def served(args, url: str, round_: int, profile: bool) -> dict:
    """One served window: `batch` concurrent streams of new prompts; ms per step over the window in which every
    request decodes."""
    import dsv41

    vocab = dsv41.load_config(args.model).vocab_size
    prompts = [[int(t) for t in np.random.default_rng(1000 * (round_ + 1) + i).integers(3, vocab, args.context)]
               for i in range(args.batch)]
    trace = {}

    async def run():
        async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=args.batch + 4)) as c:
            await _stream(c, url, prompts[0][:16], 4, [])  # warm-up
            logs = [[] for _ in prompts]
            if profile:
                (await c.post(f"{url}/start_profile")).raise_for_status()
            await asyncio.gather(*(_stream(c, url, p, args.steps, log) for p, log in zip(prompts, logs)))
            if profile:
                stopped = await c.post(f"{url}/stop_profile")
                stopped.raise_for_status()
                trace["trace_dir"] = stopped.json()["trace_dir"]
                print(f"profile: served_decode: trace written to {trace['trace_dir']}", file=sys.stderr)
            return logs

    logs = asyncio.run(run())
    start = max(log[0][0] for log in logs)  # every request has its first token: all are decoding
    end = min(log[-1][0] for log in logs)
    tokens = sum(n for log in logs for t, n in log if start < t <= end)
    return {"step_ms": 1000 * args.batch * (end - start) / tokens, "window_s": end - start,
            "tokens_in_window": tokens, **trace}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serving.bench.decode_overhead", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="preset or checkpoint (default: the tiny preset)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="alternating rounds of bare then served (default: 3)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--compilation-cache-dir", default=None, help="default: the server's")
    ap.add_argument("--out", default="bench_decode_overhead.json")
    ap.add_argument("--profile-dir", default=None, help="write jax.profiler traces of both timed parts here")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                    help="the server's async scheduling (where the model supports it; the bare steps are one at a "
                         "time either way)")
    args = ap.parse_args(argv)
    keep_freed_memory_or_say("bare steps")
    if args.compilation_cache_dir is None:
        from serving.api.server import ServerArgs

        args.compilation_cache_dir = ServerArgs().compilation_cache_dir
    r = bare_runner(args)
    rounds = []
    with server(args) as url:
        for i in range(args.repeats):
            profile = i == 0 and bool(args.profile_dir)
            b = bare(args, r, profile)
            s = served(args, url, i, profile)
            rounds.append({"bare_ms": b, "served_ms": s["step_ms"], "served_over_bare": b / s["step_ms"], **s})
            print(f"round {i + 1}: bare {b:.2f} ms/step, served {s['step_ms']:.2f} ms/step, "
                  f"served / bare {b / s['step_ms']:.3f}", file=sys.stderr)
    b_ms = statistics.median(x["bare_ms"] for x in rounds)
    s_ms = statistics.median(x["served_ms"] for x in rounds)
    ratio = b_ms / s_ms  # throughput ratio: tokens/s served over tokens/s bare
    res = {"model": args.model, "batch": args.batch, "context": args.context, "steps": args.steps,
           "async_scheduling": args.async_scheduling,
           "dtype": args.dtype, "repeats": args.repeats, "rounds": rounds,
           "bare": {"step_ms": b_ms, "tokens_per_s": 1000 * args.batch / b_ms},
           "served": {"step_ms": s_ms, "tokens_per_s": 1000 * args.batch / s_ms}, "served_over_bare": ratio}
    print(f"decode at batch {args.batch}, context {args.context}, {args.model} ({args.dtype}), "
          f"medians of {args.repeats} alternating rounds")
    print(f"{'':8} {'tokens/s':>10} {'ms/step':>8}")
    for name in ("bare", "served"):
        print(f"{name:8} {res[name]['tokens_per_s']:10.1f} {res[name]['step_ms']:8.2f}")
    per_round = ", ".join(f"{x['served_over_bare']:.3f}" for x in rounds)
    print(f"served / bare = {ratio:.3f} (target >= 0.90; rounds {per_round})")
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
