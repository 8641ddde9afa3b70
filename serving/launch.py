"""Start one server as N local processes on JAX's distributed runtime (CPU devices, collectives over gloo, the
coordinator on a free localhost port): what N hosts do, on this machine, for tests, notebooks and benchmarks.

    python -m serving.launch --num-processes 2 --devices-per-process 2 -- \\
        --model tiny --data-parallel-size 2 --tensor-parallel-size 2 --enable-expert-parallel --port 8000

Process i runs `python -m serving.server --nnodes N --node-rank i --dist-init-addr 127.0.0.1:PORT
--num-cpu-devices D` and the flags after `--`; process 0 serves HTTP (serving.engine.multiprocess). On N hosts,
run that command on each host with its own --node-rank and rank 0's host:port as --dist-init-addr.

The launcher prints each process's pid, passes SIGINT / SIGTERM on to process 0 (which stops every process), and
exits when process 0 has, with the first non-zero status of a process, or 0 when all end cleanly. Process 0
detects a dead process itself; the launcher kills it when it has not exited STOP_GRACE_S after another died.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

STOP_GRACE_S = 15.0  # after process 0 ends, the others' time to follow before they are killed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def commands(num_processes: int, devices_per_process: int, server_args: list[str]) -> list[list[str]]:
    """Each process's command line."""
    addr = f"127.0.0.1:{free_port()}"
    return [[sys.executable, "-m", "serving.server", "--nnodes", str(num_processes), "--node-rank", str(i),
             "--dist-init-addr", addr, "--num-cpu-devices", str(devices_per_process), *server_args]
            for i in range(num_processes)]


def launch(num_processes: int, devices_per_process: int, server_args: list[str]) -> int:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen(cmd, env=env) for cmd in commands(num_processes, devices_per_process, server_args)]
    for i, p in enumerate(procs):
        print(f"[dsv41-jax launch] process {i}: pid {p.pid}", file=sys.stderr, flush=True)

    def forward(signum, _frame):
        if procs[0].poll() is None:
            procs[0].send_signal(signal.SIGTERM)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    # Process 0 decides: it notices a dead process itself (503s, then exit 1: serving.engine.multiprocess); the
    # launcher steps in only when it has not within STOP_GRACE_S, and stops the others once process 0 has ended.
    died = None
    while procs[0].poll() is None:
        if died is None and any(p.poll() not in (None, 0) for p in procs[1:]):
            died = time.monotonic()
        if died is not None and time.monotonic() - died > STOP_GRACE_S:
            procs[0].kill()
        time.sleep(0.2)
    deadline = time.monotonic() + STOP_GRACE_S
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
    codes = [p.wait() for p in procs]
    return next((c for c in codes if c != 0), 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-processes", type=int, default=2)
    ap.add_argument("--devices-per-process", type=int, default=1)
    ap.add_argument("server_args", nargs=argparse.REMAINDER, help="-- then the server's flags")
    args = ap.parse_args()
    if args.num_processes < 1 or args.devices_per_process < 1:
        ap.error("--num-processes and --devices-per-process must be >= 1")
    rest = args.server_args[1:] if args.server_args[:1] == ["--"] else args.server_args
    own = [a for a in rest if a.split("=")[0] in ("--nnodes", "--node-rank", "--dist-init-addr", "--num-cpu-devices")]
    if own:
        ap.error(f"{own[0].split('=')[0]} is the launcher's to set")
    sys.exit(launch(args.num_processes, args.devices_per_process, rest))


if __name__ == "__main__":
    main()
