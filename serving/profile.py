"""`python -m serving.profile`: a trace of a few engine steps on a fixed workload, and where their time went.

Loads a model as the server does (`--model`, default the built-in nano-austen; the engine's flags too), runs an
in-process engine on `--batch` requests of `--input-len` random token ids (from `--seed`) each generating
`--output-len` tokens, once to warm up (every bucket is precompiled when the engine is built; the warm-up takes the
first-run costs out of the trace), then again with a `jax.profiler` trace around the first `--steps` steps (and the
dispatch of the one after them: the engine launches a step before making the previous one's text). Prints
host time per engine phase, device time per segment, layer and named scope, and the top ops
(`serving.engine.trace_report`); `--output-json` writes the same. The trace opens in TensorBoard / XProf (the
`.xplane.pb`) and Perfetto (`perfetto_trace.json.gz`). `--read PATH` prints the same tables for a trace taken
elsewhere (the server's `/stop_profile`, a benchmark's `--profile-dir`) without running anything.

    python -m serving.profile [--model PATH] [--batch 4] [--input-len 64] [--output-len 16] [--steps 8]
        [--profile-dir DIR] [--output-json out.json]
    python -m serving.profile --read DIR_OR_XPLANE [--output-json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import numpy as np

from serving.api.server import ServerArgs
from serving.engine.args import EngineArgs, FlagError, add_flags, from_flags
from serving.model_source import ModelArgs
from serving.runtime.host_memory import keep_freed_memory_or_say


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m serving.profile", description=__doc__.split("\n\n")[0])
    w = p.add_argument_group("workload and trace")
    w.add_argument("--batch", type=int, default=4, help="concurrent requests (default: 4)")
    w.add_argument("--input-len", type=int, default=64, help="prompt tokens per request (default: 64)")
    w.add_argument("--output-len", type=int, default=16, help="generated tokens per request (default: 16)")
    w.add_argument("--steps", type=int, default=8, help="engine steps in the trace, from the first one of the "
                   "traced round: prefill first, then decode (default: 8)")
    w.add_argument("--profile-dir", default=None, help="where the trace goes (default: a new temporary folder)")
    w.add_argument("--output-json", default=None, help="also write the tables as JSON here")
    w.add_argument("--top", type=int, default=20, help="rows of the op and scope tables (default: 20)")
    w.add_argument("--read", default=None, metavar="PATH",
                   help="only read an existing trace (a .xplane.pb, or the newest one under a folder)")
    w.add_argument("--compilation-cache-dir", default=ServerArgs.compilation_cache_dir,
                   help="persistent XLA cache, as the server's ('' turns it off)")
    add_flags(p, ModelArgs, "model", exclude=("served_model_name",))
    EngineArgs.add_flags(p)
    return p


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, ModelArgs, EngineArgs]:
    p = parser()
    ns = p.parse_args(argv)
    for name in ("batch", "input_len", "output_len", "steps", "top"):
        if getattr(ns, name) < 1:
            p.error(f"argument --{name.replace('_', '-')}: must be >= 1, got {getattr(ns, name)}")
    try:
        model, ea = from_flags(ModelArgs, ns), EngineArgs.from_flags(ns)
    except FlagError as e:
        p.error(str(e))
    if ns.input_len + ns.output_len > ea.runtime.max_model_len:
        p.error(f"argument --input-len, --output-len: {ns.input_len} + {ns.output_len} tokens exceed "
                f"--max-model-len {ea.runtime.max_model_len}")
    return ns, model, ea


def run_round(engine, prompts: list[list[int]], output_len: int, tag: str, max_steps: int | None = None) -> int:
    """Add the requests and step until they finish (or `max_steps`); the steps taken."""
    from serving.runtime.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    steps = 0
    while engine.has_unfinished() and (max_steps is None or steps < max_steps):
        engine.step()
        steps += 1
    return steps


def main(argv: list[str] | None = None) -> dict:
    ns, model_args, ea = parse_args(argv)
    if ns.read is not None:
        return read_only(ns)
    keep_freed_memory_or_say()
    ea.parallel.use_cpu_devices()  # before anything starts JAX's backends
    from serving.engine.engine import Engine
    from serving.engine.profiler import Profiler
    from serving.engine.trace_report import format_report, read_trace
    from serving.model_source import load_model
    from serving.runtime.compiler import enable_compilation_cache

    enable_compilation_cache(ns.compilation_cache_dir)
    try:
        src = load_model(model_args, ea.runtime.seed)
        _say(f"model: {src.description}; building the engine (precompiling every bucket) ...")
        engine = Engine(src.model, src.tokenizer, ea, model_name=src.name, progress=True)
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    rng = np.random.default_rng(ea.runtime.seed)
    vocab = src.model.config.vocab_size

    def prompts() -> list[list[int]]:  # fresh ids each round: the traced round gets no prefix-cache hits
        return rng.integers(0, vocab, (ns.batch, ns.input_len)).tolist()

    t = time.perf_counter()
    warm = run_round(engine, prompts(), ns.output_len, "warmup")
    _say(f"warm-up: {warm} steps in {time.perf_counter() - t:.2f}s")
    profile_dir = ns.profile_dir or tempfile.mkdtemp(prefix="dsv41-profile-")
    profiler = Profiler(profile_dir)
    profiler.start()
    try:
        traced = run_round(engine, prompts(), ns.output_len, "traced", max_steps=ns.steps)
    finally:
        trace = profiler.stop()
    if traced < ns.steps:
        _say(f"the workload finished after {traced} of --steps {ns.steps} steps")
    _say(f"trace of {traced} steps in {trace.folder}")
    report = read_trace(trace.folder)
    print(format_report(report, ns.top))
    return _write(ns, {"workload": {"batch": ns.batch, "input_len": ns.input_len, "output_len": ns.output_len,
                                    "steps": traced, "model": src.name, "engine_flags": ea.to_flags()},
                       **trace.describe(), **report.to_json(ns.top)})


def read_only(ns: argparse.Namespace) -> dict:
    from serving.engine.trace_report import format_report, read_trace

    try:
        report = read_trace(ns.read)
    except FileNotFoundError as e:
        sys.exit(f"error: --read: {e}")
    print(format_report(report, ns.top))
    return _write(ns, report.to_json(ns.top))


def _write(ns: argparse.Namespace, result: dict) -> dict:
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(result, f, indent=1)
        _say(f"wrote {ns.output_json}")
    return result


def _say(msg: str) -> None:
    print(f"[profile] {msg}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
