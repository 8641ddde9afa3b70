"""`python -m serving.bench.agentic`: an AgentX-style agentic benchmark (serving spec §7) over concurrencies
and server variants; prints a table per point and one for the sweep, writes one JSON and a PNG of plots.

    # starts `python -m serving.server --model tiny` (or --checkpoint) once per distinct set of server flags
    python -m serving.bench.agentic --concurrency 1,2,4 --duration-s 30 --variants replay-on,replay-off
    # data-parallel routing on 2 virtual CPU devices, and the mirror / lag experiment
    python -m serving.bench.agentic --concurrency 1,2 --num-sessions 8 --variants dp-sticky,dp-load --dp-mirror
    # an existing server: one variant, 'as-served' (its flags are its own)
    python -m serving.bench.agentic --base-url http://127.0.0.1:8000 --concurrency 4 --duration-s 60

Variants add server flags to --server-args: replay-on / replay-off (--[no-]swa-bounded-replay); dp-sticky /
dp-load (--data-parallel-size D --num-cpu-devices D --dp-routing-policy sticky|load); --dp-mirror adds
dp-mirror and dp-lag (client-side copies on the sticky DP server, see `agentic_runner`). The workload
(`agentic_workload.AgenticConfig`, every field a flag, --scale cpu|agentx for the defaults) and the load
model are described in those two modules. Each point gets its own cache-bust salt, so points that share a
server share no tree prefix. The server is started with the workload's --block-size and --max-context
(as --max-model-len); against --base-url, give the server's values.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from pathlib import Path

from serving.bench import serve
from serving.bench.agentic_runner import PointSpec, run_point
from serving.bench.agentic_workload import SCALES, AgenticConfig
from serving.bench.server_process import free_port, server_process

# Runtime flags of tests/serving/test_server.py: a server started with them loads its compiled steps
# from a warm cache instead of compiling (minutes on a CPU).
DEFAULT_SERVER_ARGS = "--max-num-seqs 8 --max-num-batched-tokens 64 --token-buckets 8,16,32,64"
SERVER_VARIANTS = ("replay-on", "replay-off", "dp-sticky", "dp-load")


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    server_flags: tuple[str, ...]
    mirror_lag_s: float | None = None  # None: ordinary lanes; a number: mirror copies started this far apart


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m serving.bench.agentic", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None, help="an existing server (default: start our server per variant)")
    p.add_argument("--model", default=None, help="model name to request (default: the first of /v1/models)")
    p.add_argument("--checkpoint", default="tiny", help="the started server's --model (default: the tiny preset, "
                   "which the workload's CPU scale is sized for)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--concurrency", default="1,2,4", help="lanes per point, comma-separated (mirror: per rank)")
    p.add_argument("--duration-s", type=float, default=None, help="profile length per point (no send after it)")
    p.add_argument("--num-sessions", type=int, default=None, help="session trees per point (mirror: needed)")
    p.add_argument("--seed", type=int, default=0, help="workload seed, the same for every point")
    p.add_argument("--variants", default="replay-on", help=f"comma-separated, of {', '.join(SERVER_VARIANTS)}")
    p.add_argument("--dp-size", type=int, default=2, help="data-parallel ranks of the dp-* variants")
    p.add_argument("--dp-mirror", action="store_true", help="add the dp-mirror and dp-lag variants")
    p.add_argument("--mirror-lag-s", type=float, default=2.0, help="dp-lag: start offset between rank copies")
    p.add_argument("--server-args", default=DEFAULT_SERVER_ARGS,
                   help="flags of every started server, one string (--server-args='--max-num-seqs 16 ...')")
    p.add_argument("--server-python", default=sys.executable)
    p.add_argument("--startup-timeout", type=float, default=1800.0, help="seconds to wait for /health")
    p.add_argument("--endpoint", choices=sorted(serve.ENDPOINTS), default="completions",
                   help="completions sends token ids (exact, block-aligned); chat adds the template's tokens")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--percentiles", default="50,90,99")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--out-dir", type=Path, default=Path("agentic-bench"),
                   help="agentic.json, agentic.png and the server logs go here")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--save-requests", action="store_true", help="every request's record in the JSON")
    w = p.add_argument_group("workload (agentic_workload.AgenticConfig; defaults from --scale)")
    w.add_argument("--scale", choices=sorted(SCALES), default="cpu")
    for f in dataclasses.fields(AgenticConfig):
        cpu, agentx = getattr(SCALES["cpu"], f.name), getattr(SCALES["agentx"], f.name)
        helptext = f"default {cpu} (cpu) / {agentx} (agentx)"
        if isinstance(cpu, bool):
            w.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction, default=None, help=helptext)
        elif isinstance(cpu, tuple):
            w.add_argument(_flag(f.name), default=None, metavar="LOW,HIGH", help=helptext)
        else:
            w.add_argument(_flag(f.name), type=type(cpu), default=None, help=helptext)
    return p


def _numbers(text: str, what: str, kind=float) -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what}: expected comma-separated numbers, got {text!r}") from None


def config_from_args(args: argparse.Namespace) -> AgenticConfig:
    """The --scale preset with every given workload flag over it (AgenticConfig names a bad value)."""
    given = {}
    for f in dataclasses.fields(AgenticConfig):
        value = getattr(args, f.name)
        if value is None:
            continue
        if f.name == "token_id_range":
            parts = _numbers(value, "--token-id-range", int)
            if len(parts) != 2:
                raise ValueError(f"--token-id-range: expected LOW,HIGH, got {value!r}")
            value = tuple(parts)
        given[f.name] = value
    return dataclasses.replace(SCALES[args.scale], **given)


def variants_from_args(args: argparse.Namespace) -> list[Variant]:
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in SERVER_VARIANTS]
    if unknown:
        raise ValueError(f"--variants: unknown {unknown}; choose from {', '.join(SERVER_VARIANTS)}")
    if args.dp_size < 2 and (args.dp_mirror or any(n.startswith("dp-") for n in names)):
        raise ValueError(f"--dp-size must be >= 2 for the dp variants, got {args.dp_size}")
    dp = ("--data-parallel-size", str(args.dp_size), "--num-cpu-devices", str(args.dp_size))
    flags = {"replay-on": ("--swa-bounded-replay",), "replay-off": ("--no-swa-bounded-replay",),
             "dp-sticky": dp + ("--dp-routing-policy", "sticky"), "dp-load": dp + ("--dp-routing-policy", "load")}
    if args.base_url:
        out = [Variant("as-served", ())]
    else:
        out = [Variant(n, flags[n]) for n in names]
    if not out and not args.dp_mirror:
        raise ValueError("--variants: name at least one variant (or give --dp-mirror)")
    if args.dp_mirror:
        sticky = () if args.base_url else flags["dp-sticky"]
        out += [Variant("dp-mirror", sticky, 0.0), Variant("dp-lag", sticky, args.mirror_lag_s)]
    return out


def check_args(args: argparse.Namespace) -> tuple[AgenticConfig, list[Variant], list[int]]:
    """Everything that can be wrong with the flags, found before a server starts."""
    config = config_from_args(args)
    variants = variants_from_args(args)
    concurrencies = _numbers(args.concurrency, "--concurrency", int)
    if not concurrencies or min(concurrencies) < 1:
        raise ValueError(f"--concurrency: expected positive integers, got {args.concurrency!r}")
    bad = [q for q in _numbers(args.percentiles, "--percentiles") if not 0 < q < 100]
    if bad:
        raise ValueError(f"--percentiles must lie in (0, 100), got {bad}")
    for v in variants:  # PointSpec names a bad duration / session count / mirror setting
        _spec(args, concurrencies[0], 0, v)
    salts = config.token_id_range[1] - config.token_id_range[0]
    if len(variants) * len(concurrencies) > salts:
        raise ValueError(f"{len(variants) * len(concurrencies)} sweep points but {salts} cache-bust salts "
                         "(one per id of --token-id-range)")
    return config, variants, concurrencies


def _spec(args: argparse.Namespace, concurrency: int, salt: int, v: Variant) -> PointSpec:
    return PointSpec(concurrency, seed=args.seed, salt=salt, duration_s=args.duration_s,
                     num_sessions=args.num_sessions, mirror_ranks=args.dp_size if v.mirror_lag_s is not None else 0,
                     mirror_lag_s=v.mirror_lag_s or 0.0, endpoint=args.endpoint, temperature=args.temperature,
                     percentiles=tuple(_numbers(args.percentiles, "--percentiles")),
                     request_timeout_s=args.request_timeout)


def server_command(args: argparse.Namespace, config: AgenticConfig, port: int, flags: tuple[str, ...]) -> list[str]:
    cmd = [args.server_python, "-m", "serving.server", "--host", "127.0.0.1", "--port", str(port),
           "--block-size", str(config.block_size), "--max-model-len", str(config.max_context)]
    if args.checkpoint:
        cmd += ["--model", args.checkpoint]
    return cmd + shlex.split(args.server_args) + list(flags)


def run_sweep(args: argparse.Namespace, echo=print) -> dict:
    """Every variant x concurrency point; writes <out-dir>/agentic.json (and agentic.png); returns the result."""
    config, variants, concurrencies = check_args(args)
    result = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                           if k != "api_key"},
              "workload": dataclasses.asdict(config),
              "title": (f"agentic sweep: {args.checkpoint}, seed {args.seed}, "
                        f"{'%g s' % args.duration_s if args.duration_s else f'{args.num_sessions} trees'} per point"),
              "variants": []}
    groups: dict[tuple[str, ...], list[Variant]] = {}
    for v in variants:
        groups.setdefault(v.server_flags, []).append(v)
    salt = 0
    for flags, members in groups.items():
        if args.base_url:
            echo(f"server: {args.base_url} (as served)")
            salt = _run_variants(args, config, members, concurrencies, args.base_url, salt, result, echo)
            continue
        port = free_port()
        cmd = server_command(args, config, port, flags)
        log = args.out_dir / "logs" / f"server-{'-'.join(m.name for m in members)}.log"
        echo(f"starting: {shlex.join(cmd[1:])} (log {log})")
        with server_process(cmd, port, log, args.startup_timeout) as url:
            salt = _run_variants(args, config, members, concurrencies, url, salt, result, echo)
    echo(format_sweep(result))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if not args.no_plots:
        from serving.bench.agentic_plots import plot_sweep

        result["plot"] = str(args.out_dir / "agentic.png")
        plot_sweep(result, result["plot"])
    (args.out_dir / "agentic.json").write_text(json.dumps(result, indent=1))
    echo(f"wrote {args.out_dir / 'agentic.json'}" + (f" and {result['plot']}" if "plot" in result else ""))
    return result


def _run_variants(args, config, members, concurrencies, url, salt, result, echo) -> int:
    for v in members:
        entry = {"name": v.name, "server_flags": list(v.server_flags), "points": []}
        result["variants"].append(entry)
        for c in concurrencies:
            point = run_point(url, config, _spec(args, c, salt, v), model=args.model, api_key=args.api_key,
                              keep_requests=args.save_requests)
            salt += 1
            entry["points"].append(point)
            echo(format_point(v.name, point))
    return salt


def _ms(s: dict, name: str, stats=("median", "p90", "p99")) -> str:
    return " / ".join(f"{s.get(f'{st}_{name}_ms', float('nan')):.1f}" for st in stats)


def _pct(x) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def format_point(variant: str, point: dict) -> str:
    s = point["summary"]
    inter = " / ".join("n/a" if s.get(k) is None else f"{s[k]:.1f}"
                       for k in ("p50_interactivity_tok_s", "p90_interactivity_tok_s"))
    title = f" agentic: {variant}, concurrency {point['concurrency']} "
    lines = [f"{title:=^78}",
             f"requests {s['completed']} ok / {s['failed']} failed ({s['subagent_requests']} subagent), "
             f"{s['duration']:.1f} s; trees {point['trees_started']} started / {point['trees_finished']} finished; "
             f"max in flight {point['max_requests_in_flight']}; warm-up {s['warmup_requests']} "
             f"({s['warmup_failed']} failed)",
             f"throughput: {s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s, "
             f"{s['total_token_throughput']:.1f} tok/s with cached input (peak output {s['max_output_tokens_per_s']:.0f})",
             f"TTFT ms p50 / p90 / p99:                  {_ms(s, 'ttft')}",
             f"per-request ITL (= TPOT) ms p50 / p90:    {_ms(s, 'tpot', ('median', 'p90'))}"
             f"  -> interactivity tok/s/user p50 / p90: {inter}",
             f"pooled ITL (vLLM) ms p50 / p90 / p99:     {_ms(s, 'itl')}",
             f"E2EL ms p50 / p90 / p99:                  {_ms(s, 'e2el')}",
             f"prefix hit: theoretical {_pct(s['theoretical_prefix_hit_rate'])}, achieved (usage) "
             f"{_pct(s['prefix_hit_rate'])}; acceptance length: "
             f"{'n/a (no speculative decoding)' if s['acceptance_length'] is None else s['acceptance_length']}"]
    if "mirror" in point:
        m = point["mirror"]
        lines.append(f"mirror: {m['ranks']} ranks, lag {m['lag_s']:g} s; pins confirmed {m['pins_confirmed']} "
                     f"misplaced {m['pins_misplaced']} unknown {m['pins_unconfirmed']}; all-copies window "
                     f"{m['window_s']:.1f} s: {m['window_token_throughput'] or 0:.1f} tok/s")
    for kind, n in s["errors_by_kind"].items():
        lines.append(f"errors: {kind} x{n}")
    return "\n".join(lines)


SWEEP_COLUMNS = (("conc", None), ("req/s", "request_throughput"), ("tok/s", "total_token_throughput"),
                 ("out tok/s", "output_throughput"), ("TTFT p50", "median_ttft_ms"), ("TTFT p90", "p90_ttft_ms"),
                 ("TTFT p99", "p99_ttft_ms"), ("TPOT p50", "median_tpot_ms"), ("ITLpool p90", "p90_itl_ms"),
                 ("inter p50", "p50_interactivity_tok_s"), ("inter p90", "p90_interactivity_tok_s"),
                 ("E2EL p50", "median_e2el_ms"), ("hit theo", "theoretical_prefix_hit_rate"),
                 ("hit ach", "prefix_hit_rate"), ("failed", "failed"))


def format_sweep(result: dict) -> str:
    """One row per point: tok/s counts input (cached included) + output; times in ms; interactivity tok/s/user."""
    head = f"{'variant':<11}" + "".join(f"{c:>12}" for c, _ in SWEEP_COLUMNS) + f"{'window tok/s':>14}"
    lines = [head]
    for v in result["variants"]:
        for p in v["points"]:
            s, row = p["summary"], f"{v['name']:<11}"
            for col, key in SWEEP_COLUMNS:
                x = p["concurrency"] if key is None else s.get(key)
                row += (f"{'n/a':>12}" if x is None else f"{x:>12.1%}" if key and "hit" in key
                        else f"{x:>12}" if isinstance(x, int) else f"{x:>12.2f}")
            w = p.get("mirror", {}).get("window_token_throughput")
            lines.append(row + (f"{w:>14.1f}" if w is not None else f"{'':>14}"))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = run_sweep(args)
    return 0 if all(p["summary"]["completed"] for v in result["variants"] for p in v["points"]) else 1


if __name__ == "__main__":
    sys.exit(main())
