"""Start N local processes on JAX's distributed runtime (CPU collectives over gloo, the coordinator on a
free localhost port) and serve requests across them with a sharded layout.

    python -m serving.launch --num-processes 2 --devices-per-process 2 \\
        --data-parallel-size 2 --tensor-parallel-size 2 --enable-expert-parallel --preset tiny

Each process builds the same random model, places its shards of the parameters on its devices and runs the
same serving engine (`serving.engine.Engine` on a `ShardedModel` and `MeshPlacement`): every process makes
the same scheduling decisions from the same requests, and each step is one global program over all
processes' devices; a data-parallel rank's KV cache lives only on its own devices (with dp = processes,
on its own process). `--num-requests` greedy requests with seeded random prompts, one session each (so they
spread over the data-parallel ranks). Process 0 prints JSON: each request's rank, tokens and per-step
log-probabilities with the top ones.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_requests(args: argparse.Namespace) -> dict:
    """The requests -> greedy outputs through the engine; runs in every process."""
    import jax
    import numpy as np

    import dsv41
    from serving.engine.args import EngineArgs, from_flags
    from serving.engine.engine import Engine
    from serving.runtime.config import RuntimeConfig
    from serving.runtime.kv_cache import smallest_block_size
    from serving.runtime.compiler import enable_compilation_cache
    from serving.runtime.sampling_params import SamplingParams
    from sharding.mesh import ParallelConfig

    enable_compilation_cache(args.compilation_cache_dir)
    model = dsv41.random_model(args.preset, seed=args.seed)
    c = model.config
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(3, c.vocab_size - 1, args.prompt_len).tolist() for _ in range(args.num_requests)]
    block = smallest_block_size(c)
    runtime = RuntimeConfig(max_num_seqs=max(1, args.num_requests), max_num_batched_tokens=args.prompt_len,
                            max_model_len=-(-(args.prompt_len + args.decode_steps + 1) // block) * block,
                            block_size=block, token_buckets=(args.prompt_len,),  # one compiled step size
                            swa_bounded_replay=False)
    ea = EngineArgs(runtime=runtime, parallel=from_flags(ParallelConfig, args))
    engine = Engine(model, None, ea, progress=False)
    greedy = SamplingParams(temperature=0, max_tokens=args.decode_steps, ignore_eos=True, logprobs=5)
    ranks = {}
    for i, p in enumerate(prompts):
        ranks[f"r{i}"] = engine.add_request(f"r{i}", p, greedy, session_id=f"session-{i}").rank
    out = {r: {"tokens": [], "logprobs": [], "top": []} for r in ranks}
    while engine.has_unfinished():
        for o in engine.step():
            for t, lp in zip(o.new_token_ids, o.new_logprobs):
                out[o.request_id]["tokens"].append(t)
                out[o.request_id]["logprobs"].append(lp.logprob)
                out[o.request_id]["top"].append(lp.top)
    return {"prompts": prompts, "ranks": ranks, "outputs": out, "devices": jax.device_count(),
            "processes": jax.process_count(), "data_parallel_ranks": engine.runner.ranks}


def _worker(args: argparse.Namespace) -> None:
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    t = time.perf_counter()
    out = serve_requests(args)
    out["seconds"] = round(time.perf_counter() - t, 1)
    if args.process_id == 0:
        print(json.dumps(out), flush=True)
    jax.distributed.shutdown()


def launch(args: argparse.Namespace, passthrough: list[str]) -> int:
    """Start the processes, forward process 0's output, fail if any fails (the others are then stopped)."""
    coordinator = f"127.0.0.1:{free_port()}"
    keep = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env = {**os.environ, "JAX_PLATFORMS": "cpu",  # the caller's other XLA flags stay
           "XLA_FLAGS": " ".join([*keep, f"--xla_force_host_platform_device_count={args.devices_per_process}"])}
    procs = [subprocess.Popen([sys.executable, "-m", "serving.launch", "--worker", "--process-id", str(i),
                               "--num-processes", str(args.num_processes), "--coordinator", coordinator, *passthrough],
                              env=env, stdout=subprocess.PIPE if i == 0 else subprocess.DEVNULL, text=True)
             for i in range(args.num_processes)]
    deadline = time.monotonic() + args.timeout
    rc = 0
    while any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
            rc = 1
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.2)
    sys.stdout.write(procs[0].stdout.read())
    return rc or max(p.wait() for p in procs)


def main() -> None:
    from serving.engine.args import FlagError, add_flags, from_flags
    from sharding.mesh import ParallelConfig

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-processes", type=int, default=2)
    ap.add_argument("--devices-per-process", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-len", type=int, default=12)
    ap.add_argument("--decode-steps", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=2)
    ap.add_argument("--compilation-cache-dir", default="",
                    help="persistent XLA cache ('' = off, the default: on jax 0.12 steps loaded from a warm cache "
                         "fail to set up the CPU collectives between the processes - Gloo context timeouts)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    # each process's devices are --devices-per-process, so the layout's --num-cpu-devices does not apply here
    add_flags(ap, ParallelConfig, "parallelism", exclude=("num_cpu_devices",))
    args = ap.parse_args()
    try:
        from_flags(ParallelConfig, args)
    except FlagError as e:
        ap.error(str(e))
    if args.worker:
        _worker(args)
        return
    if args.num_processes < 1 or args.devices_per_process < 1:
        raise SystemExit("--num-processes and --devices-per-process must be >= 1")
    own = {"--num-processes", "--devices-per-process", "--timeout"}
    argv, passthrough, skip = sys.argv[1:], [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a.split("=")[0] in own:
            skip = "=" not in a
            continue
        passthrough.append(a)
    sys.exit(launch(args, passthrough))


if __name__ == "__main__":
    main()
