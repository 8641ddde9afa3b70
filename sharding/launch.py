"""Start N local processes on JAX's distributed runtime (CPU collectives over gloo, the coordinator on a
free localhost port) and serve one request across them with a sharded layout.

    python -m sharding.launch --num-processes 2 --devices-per-process 2 \\
        --data-parallel-size 2 --tensor-parallel-size 2 --enable-expert-parallel --preset tiny

Each process builds the same random model, places its shards of the parameters on its devices, and runs
the prefill and greedy decode steps as one global program: the sequence padded to a fixed length (the
model is causal, so rows before the padding are exact), one compile for all steps. Process 0 prints
JSON: the generated tokens and the logits of the prompt's last row and of every decode step.
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


def serve_one_request(args: argparse.Namespace) -> dict:
    """The request (prompt = seeded random ids) -> greedy tokens and per-step logits; runs in every process."""
    import jax
    import numpy as np

    import dsv41
    from sharding.mesh import ParallelConfig
    from sharding.model import ShardedModel

    model = dsv41.random_model(args.preset, seed=args.seed)
    prompt = np.random.default_rng(args.seed).integers(3, model.config.vocab_size - 1, args.prompt_len)
    total = args.prompt_len + args.decode_steps
    seq = np.zeros(total, np.int64)  # positions past the current length are padding (causal: never read)
    seq[: args.prompt_len] = prompt
    sm = ShardedModel(model, ParallelConfig.from_args(args)) if jax.device_count() > 1 else model
    rows = []
    for n in range(args.prompt_len, total + 1):
        logits = sm.logits(seq)[n - 1]
        rows.append(logits)
        if n < total:
            seq[n] = int(np.argmax(logits))
    return {"tokens": seq.tolist(), "logits": np.stack(rows).tolist(), "devices": jax.device_count(),
            "processes": jax.process_count()}


def _worker(args: argparse.Namespace) -> None:
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    t = time.perf_counter()
    out = serve_one_request(args)
    out["seconds"] = round(time.perf_counter() - t, 1)
    if args.process_id == 0:
        print(json.dumps(out), flush=True)
    jax.distributed.shutdown()


def launch(args: argparse.Namespace, passthrough: list[str]) -> int:
    """Start the processes, forward process 0's output, fail if any fails (the others are then stopped)."""
    coordinator = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={args.devices_per_process}"}
    procs = [subprocess.Popen([sys.executable, "-m", "sharding.launch", "--worker", "--process-id", str(i),
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
    from sharding.mesh import ParallelConfig
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-processes", type=int, default=2)
    ap.add_argument("--devices-per-process", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-len", type=int, default=12)
    ap.add_argument("--decode-steps", type=int, default=3)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    ParallelConfig.add_arguments(ap)
    args = ap.parse_args()
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
