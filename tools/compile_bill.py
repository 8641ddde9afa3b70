"""What a command compiles with XLA, in every Python process it starts, and what it compiles more than once.

    python tools/compile_bill.py run OUT_DIR -- .venv/bin/python -m pytest -q -n 2 --dist loadfile
    python tools/compile_bill.py report OUT_DIR [--json bill.json]

`run` starts the command with a `sitecustomize` module first on PYTHONPATH (every Python process it starts inherits
it: pytest workers, servers, notebook kernels, sharding workers; the `sitecustomize` it hides, if any, still runs).
Once a process imports JAX's compiler, the module wraps its persistent-cache write and read, so each XLA compile is
logged with its cache key (the HLO fingerprint with the compile options), seconds and module name, and each
persistent-cache hit too, with the pytest test that ran it (PYTEST_CURRENT_TEST, inherited by subprocesses). It
imports nothing until a process imports JAX itself, so a process that must not load JAX stays without it. Compiles
are logged only where JAX's persistent cache is on (the suite, the server and `LLM` turn it on); a cache key compiled
twice is a program compiled again that a cache could have served.

`report` prints the compile seconds by kind of program and by test file, the model's programs (segments, the full
forward, the speculative finish) per test, and the repeats (docs/testing.md, "What the suite compiles").
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

LOG_DIR_VAR = "COMPILE_BILL_DIR"
MODEL_PROGRAMS = ("jit_segment1", "jit_segment2", "jit__forward_leaves", "jit_speculative")

# the module every process of the command imports at start-up; @LOG_DIR_VAR@ is replaced by LOG_DIR_VAR
_SITECUSTOMIZE = '''
import os, sys, time, json
_dir = os.environ.get("@LOG_DIR_VAR@")


def _patch(compiler):
    out = os.path.join(_dir, f"{os.getpid()}.jsonl")
    write, read = compiler._cache_write, compiler._cache_read

    def log(kind, key, name, seconds):
        with open(out, "a") as f:
            f.write(json.dumps({"kind": kind, "key": key, "name": name, "s": seconds,
                                "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
                                "argv": " ".join(sys.argv[:2])[:200]}) + "\\n")

    def logged_write(cache_key, compile_time_secs, module_name, *args, **kwargs):
        log("compile", cache_key, module_name, compile_time_secs)
        return write(cache_key, compile_time_secs, module_name, *args, **kwargs)

    def logged_read(module_name, cache_key, *args, **kwargs):
        start = time.perf_counter()
        got = read(module_name, cache_key, *args, **kwargs)
        if got[0] is not None:
            log("hit", cache_key, module_name, time.perf_counter() - start)
        return got

    compiler._cache_write, compiler._cache_read = logged_write, logged_read


class _Finder:
    """Patches jax._src.compiler right after it is first imported."""

    def find_spec(self, name, path=None, target=None):
        if name != "jax._src.compiler":
            return None
        sys.meta_path.remove(self)
        import importlib.util
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def patched(module):
            exec_module(module)
            _patch(module)
        spec.loader.exec_module = patched
        return spec


def _run_shadowed():
    """Run the sitecustomize this one hides (a venv's own, say), as Python would have without the tool."""
    import importlib.machinery, importlib.util
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if os.path.abspath(entry or os.getcwd()) == here:
            continue
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [entry])
        if spec is not None:
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


if _dir:
    sys.meta_path.insert(0, _Finder())
_run_shadowed()
'''


def run(out_dir: Path, command: list[str]) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="compile-bill-") as site:
        Path(site, "sitecustomize.py").write_text(_SITECUSTOMIZE.replace("@LOG_DIR_VAR@", LOG_DIR_VAR))
        env = {**os.environ, LOG_DIR_VAR: str(out_dir.resolve()),
               "PYTHONPATH": os.pathsep.join([site] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                       if p])}
        return subprocess.run(command, env=env).returncode


def read_log(out_dir: Path) -> list[dict]:
    rows = []
    for path in sorted(out_dir.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a process killed mid-line
                continue
    return rows


def _where(row: dict) -> str:
    return row["test"].split("::")[0] if row["test"] else f"(outside pytest) {row['argv']}"


def bill(rows: list[dict]) -> dict:
    """The log summed: totals, seconds by module name and by test file, the model's programs per test, repeats."""
    compiles = [r for r in rows if r["kind"] == "compile"]
    seen, repeats = set(), []
    for r in compiles:
        if r["key"] in seen:
            repeats.append(r)
        seen.add(r["key"])

    def by(key, items):
        acc = collections.defaultdict(lambda: [0, 0.0])
        for r in items:
            acc[key(r)][0] += 1
            acc[key(r)][1] += r["s"]
        return sorted(([k, n, round(s, 1)] for k, (n, s) in acc.items()), key=lambda x: -x[2])

    model = [r for r in compiles if r["name"].split("-")[0] in MODEL_PROGRAMS]
    return {
        "compiles": len(compiles), "compile_s": round(sum(r["s"] for r in compiles), 1),
        "model_programs": len(model), "model_program_s": round(sum(r["s"] for r in model), 1),
        "repeated_compiles": len(repeats), "repeated_s": round(sum(r["s"] for r in repeats), 1),
        "persistent_cache_hits": sum(r["kind"] == "hit" for r in rows),
        "by_module": by(lambda r: r["name"].split("-")[0], compiles),
        "by_file": by(_where, compiles),
        "model_programs_by_test": by(lambda r: r["test"].split(" ")[0] or r["argv"], model),
        "repeats_by_file": by(_where, repeats),
    }


def print_bill(b: dict, top: int = 25) -> None:
    print(f"{b['compiles']:,} XLA compiles, {b['compile_s']:,.0f} s; the model's programs {b['model_programs']} "
          f"({b['model_program_s']:,.0f} s); compiled again {b['repeated_compiles']:,} ({b['repeated_s']:,.0f} s); "
          f"persistent-cache hits {b['persistent_cache_hits']}")
    for title, table in (("by module", "by_module"), ("by test file", "by_file"),
                         ("the model's programs by test", "model_programs_by_test"),
                         ("compiled again, by test file", "repeats_by_file")):
        print(f"\n{title}:\n{'seconds':>9} {'compiles':>8}  name")
        for name, n, s in b[table][:top]:
            print(f"{s:9.1f} {n:8d}  {name}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a command with every XLA compile logged to OUT_DIR")
    r.add_argument("out_dir", type=Path)
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    p = sub.add_parser("report", help="the bill of a logged run")
    p.add_argument("out_dir", type=Path)
    p.add_argument("--json", type=Path, default=None, help="also write the bill here")
    p.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    if args.cmd == "run":
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            ap.error("run needs a command after --")
        return run(args.out_dir, command)
    rows = read_log(args.out_dir)
    if not rows:
        print(f"no compiles logged in {args.out_dir}", file=sys.stderr)
        return 1
    b = bill(rows)
    print_bill(b, args.top)
    if args.json:
        args.json.write_text(json.dumps(b, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
