"""Served decode throughput vs the bare jitted decode step, side by side in one run.

bare    the runtime alone: `batch` requests prefilled to `context` tokens, then `steps` decode steps of
        `Runner.step` (host batch build + both segments + on-device sampling + the tokens' copy to the host);
        tokens/s = batch / median step time.
served  `python -m serving.server` with the same engine configuration, `batch` concurrent streaming
        completions of `context` token-id prompts and `steps` forced output tokens; tokens/s counted over
        the window in which every request is decoding (from the last first-token to the first last-token),
        from each chunk's arrival time and token ids - scheduler, detokenizer, SSE and HTTP included.

`--profile-dir DIR`: a `jax.profiler` trace of both timed parts - the bare steps in this process, the served
window through the server's `/start_profile` / `/stop_profile` - each in its own session folder.

    python -m serving.bench.decode_overhead [--model small] [--batch 32] [--context 256] [--steps 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def _engine_args(args):
    """The engine configuration both sides run (the bare runner takes its runtime section, the server its flags)."""
    from serving.engine.args import EngineArgs

    return EngineArgs.of(max_num_seqs=args.batch, max_num_batched_tokens=args.max_num_batched_tokens,
                         max_model_len=args.context + args.steps + 8, block_size=args.block_size,
                         token_buckets=tuple(sorted({args.batch, args.max_num_batched_tokens})))


def bare(args) -> dict:
    import dsv41
    from serving.bench.prefill import bench_decode
    from serving.runtime.runner import Runner, enable_compilation_cache

    enable_compilation_cache(args.compilation_cache_dir)
    model = (dsv41.random_model(args.model, dtype=args.dtype) if args.model in dsv41.PRESETS
             else dsv41.load(args.model, dtype=args.dtype))
    r = Runner(model, _engine_args(args).runtime, progress=False)
    r.precompile()
    tps = bench_decode(r, args.batch, args.context, args.steps, model.config.vocab_size, args.profile_dir,
                       "bare_decode")
    return {"tokens_per_s": tps, "step_ms": 1000 * args.batch / tps}


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


def served(args) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "serving.server", "--port", str(port), "--disable-access-log", "--log-level",
           "warning", "--compilation-cache-dir", args.compilation_cache_dir, "--dtype", args.dtype,
           "--no-background-compile",  # measured steps must not share the CPU with the other buckets' compiles
           *_engine_args(args).to_flags()]
    if args.model:
        cmd += ["--model", args.model]
    if args.profile_dir:
        cmd += ["--profile-dir", str(Path(args.profile_dir).absolute())]  # the server runs in another folder
    trace = {}
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        import dsv41

        vocab = dsv41.load_config(args.model).vocab_size
        prompts = [[int(t) for t in np.random.default_rng(1000 + i).integers(3, vocab, args.context)]
                   for i in range(args.batch)]

        async def run():
            async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=args.batch + 4)) as c:
                await _stream(c, url, prompts[0][:16], 4, [])  # warm-up
                logs = [[] for _ in prompts]
                if args.profile_dir:
                    (await c.post(f"{url}/start_profile")).raise_for_status()
                await asyncio.gather(*(_stream(c, url, p, args.steps, log) for p, log in zip(prompts, logs)))
                if args.profile_dir:
                    stopped = await c.post(f"{url}/stop_profile")
                    stopped.raise_for_status()
                    trace["trace_dir"] = stopped.json()["trace_dir"]
                    print(f"profile: served_decode: trace written to {trace['trace_dir']}", file=sys.stderr)
                return logs

        logs = asyncio.run(run())
    finally:
        proc.terminate()
        proc.wait(30)
    start = max(log[0][0] for log in logs)  # every request has its first token: all are decoding
    end = min(log[-1][0] for log in logs)
    tokens = sum(n for log in logs for t, n in log if start < t <= end)
    return {"tokens_per_s": tokens / (end - start), "window_s": end - start, "tokens_in_window": tokens, **trace}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serving.bench.decode_overhead", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="preset or checkpoint (default: the tiny preset)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--compilation-cache-dir", default=None, help="default: the server's")
    ap.add_argument("--out", default="bench_decode_overhead.json")
    ap.add_argument("--profile-dir", default=None, help="write jax.profiler traces of both timed parts here")
    args = ap.parse_args(argv)
    if args.compilation_cache_dir is None:
        from serving.api.server import ServerArgs

        args.compilation_cache_dir = ServerArgs().compilation_cache_dir
    b = bare(args)
    s = served(args)
    ratio = s["tokens_per_s"] / b["tokens_per_s"]
    res = {"model": args.model, "batch": args.batch, "context": args.context,
           "steps": args.steps, "dtype": args.dtype, "bare": b, "served": s, "served_over_bare": ratio}
    print(f"decode at batch {args.batch}, context {args.context}, {args.model} ({args.dtype})")
    print(f"{'':8} {'tokens/s':>10} {'ms/step':>8}")
    print(f"{'bare':8} {b['tokens_per_s']:10.1f} {b['step_ms']:8.2f}")
    print(f"{'served':8} {s['tokens_per_s']:10.1f} {1000 * args.batch / s['tokens_per_s']:8.2f}")
    print(f"served / bare = {ratio:.3f} (target >= 0.90)")
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
