"""`python -m serving.bench.defaults`: the serving defaults chosen by measurement - candidate flag sets served side
by side on the peers workload and the agentic workload, and the rule that picks the default from them.

    python -m serving.bench.defaults [--model tiny|PATH] [--rounds 2] \
        [--candidate 'budget-2048=--max-num-batched-tokens 2048' ...] [--output-json defaults.json]

Each candidate is a name and the server flags it adds to the defaults (the first candidate, `defaults`, adds
none). First every candidate's server starts once with an empty compile cache of its own, as a user starts it, and
serves the peers workload at concurrency 8 in back-to-back waves from the moment it is ready until `--cold-seconds`
after launch (`serving.bench.full_speed`), then idles until it has compiled every program: its cold point is the
output tokens its finished waves served by then, and its cost the programs and the seconds until all were
compiled. Then, in each round, every candidate's server starts on its cache (every program loaded) and serves
  - the peers workload: 512 random token ids in, 64 out, greedy, streamed, at concurrency 1 (4 requests) and 8
    (16 requests): output tokens/s;
  - the agentic workload (`serving.bench.agentic_runner`, its CPU scale, the server's own KV block size) at the
    `--agentic-concurrency` lanes for `--agentic-duration` seconds each: requests/s.
The candidates' order alternates round by round (this machine's speed drifts over minutes) and each warm point's
figure is the median over the rounds (the cold point is one run: a cold start costs minutes).

The rule (`choose`): a candidate's score is its worst ratio, over the points (cold and warm), to the best candidate at
that point; the default is the highest score, and candidates within `TIE` of it count as equal, the one with the
fewest programs first. The issue's bar: the default within 10% of the best at every point.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from serving.bench import full_speed, side_by_side
from serving.bench.agentic_runner import PointSpec, run_point
from serving.bench.agentic_workload import SCALES
from serving.bench.server_process import free_port, server_process, wait_until_all_compiled

TIE = 0.03  # score differences below this are within a 2-core machine's run-to-run noise
BAR = 0.90  # the "within 10% of the best flags"
PEERS_CONCURRENCY = (1, 8)
MODEL_NAME = "bench-model"
# the default budget (512) against its neighbours
DEFAULT_CANDIDATES = ("defaults=", "budget-256=--max-num-batched-tokens 256",
                      "budget-1024=--max-num-batched-tokens 1024")


@dataclass(frozen=True)
class Candidate:
    name: str
    flags: tuple[str, ...]  # added to the server's defaults


def parse_candidate(text: str) -> Candidate:
    """'NAME=FLAGS' -> Candidate (FLAGS split as a shell would; may be empty)."""
    name, sep, flags = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ValueError(f"--candidate {text!r}: expected NAME=FLAGS with a name of letters, digits, '_', '.', '-'")
    return Candidate(name, tuple(shlex.split(flags)))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m serving.bench.defaults", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a checkpoint folder or preset (default: the built-in model)")
    p.add_argument("--candidate", action="append", default=None,
                   help=f"NAME=FLAGS, repeatable (default: {'; '.join(DEFAULT_CANDIDATES)})")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--agentic-concurrency", default="2,8")
    p.add_argument("--agentic-duration", type=float, default=30.0)
    p.add_argument("--cold-seconds", type=float, default=120.0, help="how long after launch the cold waves run")
    p.add_argument("--token-ids", default="10,8000", help="the peers prompts' id range (the peer client's)")
    p.add_argument("--startup-timeout", type=float, default=1800.0)
    p.add_argument("--log-dir", type=Path, default=Path("bench-logs/defaults"))
    p.add_argument("--output-json", default=None)
    return p


def _server(args, cand: Candidate, cache: Path, port: int) -> list[str]:
    model = ["--model", args.model] if args.model else []
    return [sys.executable, "-m", "serving.server", *model, "--served-model-name", MODEL_NAME, "--port", str(port),
            "--compilation-cache-dir", str(cache), "--disable-access-log", *cand.flags]


def cold_cost(args, cand: Candidate, cache: Path) -> dict:
    """From an empty cache: {"ready_s", "all_compiled_s", "programs", "block_size" (from the server's banner),
    "served_tokens" (the c=8 waves' output tokens by --cold-seconds after launch), "waves"}."""
    run = argparse.Namespace(model=args.model, server_arg=["--disable-access-log", *cand.flags], log_dir=args.log_dir,
                             startup_timeout=args.startup_timeout, concurrency=8, num_prompts=16, input_len=512,
                             output_len=64, token_ids=args.token_ids)
    got = full_speed.ours(run, str(cache), until=args.cold_seconds, count=None, who=f"{cand.name}-cold",
                          wait_all_compiled=True)
    m = re.search(r"compiled ([0-9.]+)s after launch \((\d+) step programs\)", got["all_compiled"])
    block = re.search(r"blocks of (\d+) tokens", (args.log_dir / f"{cand.name}-cold.log").read_text(errors="replace"))
    served = sum(w["output_tokens"] for w in got["waves"] if w["end_s"] <= args.cold_seconds)
    return {"ready_s": got["ready_s"], "all_compiled_s": float(m.group(1)), "programs": int(m.group(2)),
            "block_size": int(block.group(1)), "served_tokens": served, "waves": got["waves"]}


def measure(args, cand: Candidate, cache: Path, block_size: int, round_: int) -> dict[str, float]:
    """One round of one warm candidate: {point: throughput}, from the moment its programs are all loaded (a warm
    restart is ready before its cache has loaded the others: a point measured then runs beside the loading)."""
    port, log = free_port(), args.log_dir / f"{cand.name}-round{round_}.log"
    out = {}
    with server_process(_server(args, cand, cache, port), port, log, args.startup_timeout) as url:
        wait_until_all_compiled(log, args.startup_timeout)
        for c in PEERS_CONCURRENCY:
            run = argparse.Namespace(concurrency=c, num_prompts=16 if c > 1 else 4, num_warmups=2, input_len=512,
                                     output_len=64, seed=0)
            summary = side_by_side.run_client(url, MODEL_NAME, run, args.token_ids,
                                              args.log_dir / f"{cand.name}-round{round_}-c{c}.json")["summary"]
            out[f"peers c={c} out tok/s"] = summary["output_throughput"]
        config = replace(SCALES["cpu"], block_size=block_size)
        for salt, c in enumerate(args.agentic_concurrency):
            point = run_point(url, config, PointSpec(c, salt=salt, duration_s=args.agentic_duration),
                              model=MODEL_NAME)
            if point["summary"]["failed"]:
                raise SystemExit(f"{cand.name}: {point['summary']['failed']} agentic requests failed (log {log})")
            out[f"agentic c={c} req/s"] = point["summary"]["request_throughput"]
    return out


def choose(medians: dict[str, dict[str, float]], programs: dict[str, int], tie: float = TIE) -> dict:
    """The rule over {candidate: {point: throughput}}: {"ratios": {candidate: {point: throughput / the point's
    best}}, "scores": {candidate: its worst ratio}, "chosen": the candidate, "tied": those within `tie`}."""
    points = list(next(iter(medians.values())))
    best = {p: max(m[p] for m in medians.values()) for p in points}
    ratios = {c: {p: m[p] / best[p] for p in points} for c, m in medians.items()}
    scores = {c: min(r.values()) for c, r in ratios.items()}
    top = max(scores.values())
    tied = [c for c in medians if scores[c] >= top - tie]
    chosen = min(tied, key=lambda c: (programs[c], -scores[c]))
    return {"ratios": ratios, "scores": scores, "chosen": chosen, "tied": tied}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    cands = [parse_candidate(t) for t in (args.candidate or DEFAULT_CANDIDATES)]
    if len({c.name for c in cands}) != len(cands):
        raise SystemExit("--candidate: names must differ")
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    try:
        args.agentic_concurrency = [int(x) for x in args.agentic_concurrency.split(",")]
    except ValueError:
        args.agentic_concurrency = []
    if not args.agentic_concurrency or min(args.agentic_concurrency) < 1:
        raise SystemExit("--agentic-concurrency: expected positive integers, comma-separated")
    args.log_dir.mkdir(parents=True, exist_ok=True)
    caches = {c.name: args.log_dir / "cache" / c.name for c in cands}
    cold = {}
    for c in cands:
        cold[c.name] = cold_cost(args, c, caches[c.name])
        print(f"{c.name}: cold " + ", ".join(f"{k} {v}" for k, v in cold[c.name].items() if k != "waves"), flush=True)
    rounds: dict[str, list[dict[str, float]]] = {c.name: [] for c in cands}
    for r in range(args.rounds):
        for c in (cands if r % 2 == 0 else cands[::-1]):
            rounds[c.name].append(measure(args, c, caches[c.name], cold[c.name]["block_size"], r))
            print(f"round {r} {c.name}: {rounds[c.name][-1]}", flush=True)
    cold_point = f"cold c=8 out tokens by {args.cold_seconds:g} s"
    medians = {n: {cold_point: cold[n]["served_tokens"], **{p: statistics.median(x[p] for x in rs) for p in rs[0]}}
               for n, rs in rounds.items()}
    rule = choose(medians, {n: cold[n]["programs"] for n in cold})
    result = {"model": args.model or "(built-in)", "candidates": {c.name: list(c.flags) for c in cands},
              "rule": f"highest worst-point ratio to the best; within {TIE} tied, fewest programs first",
              "cold": cold, "rounds": rounds, "medians": medians, **rule}
    print(format_table(result))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.output_json}")
    return 0


def format_table(result: dict) -> str:
    points = list(next(iter(result["medians"].values())))
    lines = [f"model {result['model']}; medians of {len(next(iter(result['rounds'].values())))} rounds; "
             f"rule: {result['rule']}",
             " | ".join(["candidate", "programs", "all compiled s", *points, "score"])]
    for name, m in result["medians"].items():
        cells = [f"{m[p]:.0f}" if m[p] >= 100 else f"{m[p]:.2f}" for p in points]
        cells = [f"{v} ({result['ratios'][name][p]:.2f})" for v, p in zip(cells, points)]
        mark = " <- chosen" if name == result["chosen"] else (" (tied)" if name in result["tied"] else "")
        cold = result["cold"][name]
        lines.append(" | ".join([name, str(cold["programs"]), f"{cold['all_compiled_s']:.0f}", *cells,
                                 f"{result['scores'][name]:.2f}{mark}"]))
    defaults = [name for name, flags in result["candidates"].items() if not flags]
    if defaults:
        lines.append(f"the defaults' worst ratio to the best: {result['scores'][defaults[0]]:.2f} (bar {BAR:.2f})")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
