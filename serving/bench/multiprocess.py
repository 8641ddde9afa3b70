"""`python -m serving.bench.multiprocess`: what serving over two processes costs per step, against one process on
the same 4-device layout.

For each model (tiny V4.1 preset, a tiny V4 checkpoint written by `make_checkpoints`) and layout (DEP dp=2 x tp=2
with experts over all 4 devices; TP4), two servers are started one after the other from launch: one process with 4
CPU devices (`--num-cpu-devices 4`) and two processes with 2 each (`serving.launch`). Each serves:
- a fixed check set (4 concurrent greedy streams, 12-37 token prompts, logprobs): greedy tokens equal and the largest
  logprob difference against the one-process server;
- decode waves at concurrency B (8 and 64 by default: 2B requests of 16 prompt / 32 output token ids, ignore_eos,
  `serving.bench.serve`): output tok/s and the median TPOT, and from rank 0's `/metrics` the steps it published to
  the other process, their bytes and its time publishing them (pickling + the key-value store's round trip).
Both servers run `--no-swa-bounded-replay` (with it on, where a chunk ends - which depends on the streams' arrival
times - changes which rows the decoder layers keep, so two runs of one server differ too) and small buckets.
On a 2-core machine the two processes and their 4 device threads share the cores: the TPOT ratio is that machine's,
not a network's. Prints a table and writes JSON (`--out`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from serving.bench import make_checkpoints, serve
from serving.bench.server_process import free_port, server_process

LAYOUTS = {"dep": ["--data-parallel-size", "2", "--tensor-parallel-size", "2", "--enable-expert-parallel"],
           "tp4": ["--tensor-parallel-size", "4"]}
CHECK_PROMPTS = [list(range(100, 112)), list(range(200, 237)), [7] * 21 + list(range(300, 320)), list(range(50, 70))]


def server_flags(max_concurrency: int) -> list[str]:
    """Capacity for `max_concurrency` streams on every layout (a DEP rank holds half of them), few buckets."""
    return ["--max-num-seqs", str(max_concurrency), "--max-num-batched-tokens", "64", "--max-model-len", "256",
            "--token-buckets", f"8,{max(8, max_concurrency // 2)},{max(8, max_concurrency)}",
            "--no-swa-bounded-replay", "--no-background-compile", "--disable-access-log"]


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for name in ("dsv41:step_broadcasts_total", "dsv41:step_broadcast_bytes_total",
                 "dsv41:step_broadcast_seconds_total"):
        m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    return out


def check_set(url: str) -> list[dict]:
    """The check requests' greedy token ids and logprobs, sent concurrently."""
    def one(prompt):
        r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                      "logprobs": 1, "ignore_eos": True, "return_token_ids": True},
                       timeout=600)
        r.raise_for_status()
        ch = r.json()["choices"][0]
        return {"tokens": ch["token_ids"], "logprobs": ch["logprobs"]["token_logprobs"]}

    with concurrent.futures.ThreadPoolExecutor(len(CHECK_PROMPTS)) as pool:
        return list(pool.map(one, CHECK_PROMPTS))


def waves(url: str, model: str, batches: list[int], vocab: int) -> dict:
    out = {}
    for b in batches:
        before = _metrics(url)
        args = serve.parse_args(["--base-url", url, "--model", model, "--dataset", "random", "--input-len", "16",
                                 "--output-len", "32", "--num-prompts", str(2 * b), "--max-concurrency", str(b),
                                 "--ignore-eos", "--num-warmups", str(min(b, 8)), "--token-id-range",
                                 f"10,{vocab - 1}"])
        s = serve.run(args)["summary"]
        after = _metrics(url)
        steps = after["dsv41:step_broadcasts_total"] - before["dsv41:step_broadcasts_total"]
        row = {"output_tok_s": s["output_throughput"], "median_tpot_ms": s["median_tpot_ms"],
               "completed": s["completed"], "failed": s["failed"]}
        if steps:
            row.update(steps=steps,
                       bytes_per_step=(after["dsv41:step_broadcast_bytes_total"]
                                       - before["dsv41:step_broadcast_bytes_total"]) / steps,
                       publish_us_per_step=1e6 * (after["dsv41:step_broadcast_seconds_total"]
                                                  - before["dsv41:step_broadcast_seconds_total"]) / steps)
        out[b] = row
    return out


def run_server(processes: int, model: str, layout: str, batches: list[int], log: Path, cache: Path,
               vocab: int) -> dict:
    port = free_port()
    flags = ["--model", model, "--port", str(port), "--compilation-cache-dir", str(cache), *LAYOUTS[layout],
             *server_flags(max(batches))]
    if processes == 1:
        cmd = [sys.executable, "-m", "serving.server", "--num-cpu-devices", "4", *flags]
    else:
        cmd = [sys.executable, "-m", "serving.launch", "--num-processes", str(processes), "--devices-per-process",
               str(4 // processes), "--", *flags]
    t0 = time.perf_counter()
    with server_process(cmd, port, log, 3600) as url:
        ready = time.perf_counter() - t0
        name = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        return {"ready_s": ready, "check": check_set(url), "waves": waves(url, name, batches, vocab)}


def compare(one: list[dict], two: list[dict]) -> dict:
    same = all(a["tokens"] == b["tokens"] for a, b in zip(one, two))
    diff = max(float(np.abs(np.array(a["logprobs"]) - np.array(b["logprobs"])).max()) for a, b in zip(one, two))
    return {"tokens_equal": same, "max_logprob_diff": diff}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m serving.bench.multiprocess", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="v41,v4", help="comma-separated: v41 (tiny preset), v4 (tiny checkpoint)")
    p.add_argument("--layouts", default="dep,tp4")
    p.add_argument("--batches", default="8,64")
    p.add_argument("--out", default="docs/benchmarks/multiprocess.json")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    work = Path(tempfile.mkdtemp(prefix="dsv41-multiprocess-"))
    make_checkpoints.main([str(work / "ckpt"), "--size", "tiny"])
    models = {"v41": ("tiny", 512), "v4": (str(work / "ckpt" / "v4"), 512)}
    rows = []
    for m in args.models.split(","):
        for layout in args.layouts.split(","):
            model, vocab = models[m]
            res = {n: run_server(n, model, layout, batches, work / f"{m}-{layout}-{n}.log", work / "cache", vocab)
                   for n in (1, 2)}
            rows.append({"model": m, "layout": layout, "one": res[1], "two": res[2],
                         **compare(res[1]["check"], res[2]["check"])})
            _print_row(rows[-1], batches)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "batches": batches, "rows": rows},
                                         indent=1))
    print(f"wrote {args.out}")
    return 0 if all(r["tokens_equal"] and r["max_logprob_diff"] <= 1e-5 for r in rows) else 1


def _print_row(r: dict, batches: list[int]) -> None:
    print(f"{r['model']} {r['layout']}: ready {r['one']['ready_s']:.0f} s (1 process) / {r['two']['ready_s']:.0f} s "
          f"(2); check set tokens equal {r['tokens_equal']}, max logprob diff {r['max_logprob_diff']:.2e}")
    print("| batch | 1 process tok/s | 2 processes tok/s | TPOT ms 1 / 2 | bytes / step | publish us / step |")
    print("|---:|---:|---:|---|---:|---:|")
    for b in batches:
        one, two = r["one"]["waves"][b], r["two"]["waves"][b]
        print(f"| {b} | {one['output_tok_s']:.0f} | {two['output_tok_s']:.0f} | {one['median_tpot_ms']:.1f} / "
              f"{two['median_tpot_ms']:.1f} | {two.get('bytes_per_step', 0):.0f} | "
              f"{two.get('publish_us_per_step', 0):.0f} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
