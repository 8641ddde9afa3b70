"""A server as a child process of a benchmark: a free port, started in its own process group from the repository
root, ready once GET /health answers 200, stopped (the whole group) on the way out, also on errors or Ctrl-C.
`side_by_side`, `peers`, `agentic` and `decode_overhead` start theirs (ours, vLLM, the stand-in of the tests)
through it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server_process(cmd: list[str], port: int, log_path: Path | None, startup_timeout: float, env: dict | None = None):
    """Start `cmd` in its own process group (environment `env`, default this process's; its output to `log_path`,
    or discarded with None), yield its base URL once GET /health answers 200, and stop the whole group on exit
    (SIGTERM, then SIGKILL after 30 s)."""
    if log_path is None:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                start_new_session=True, env=env)
    else:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, start_new_session=True,
                                    env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-3000:] if log_path else "(its output was not kept)"
                raise RuntimeError(f"server exited with code {proc.returncode} before /health answered; "
                                   f"log {log_path}:\n{tail}")
            try:
                if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not healthy after {startup_timeout:.0f} s; log {log_path}")
            time.sleep(0.5)
        yield url
    finally:
        _stop(proc)


def wait_until_all_compiled(log: Path, timeout: float) -> None:
    """Wait until the server's log says every step program is compiled (the banner's "all programs compiled": on a
    warm restart, loaded from the cache; the warm steady state starts there)."""
    deadline = time.monotonic() + timeout
    while "all programs compiled" not in log.read_text(errors="replace"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"not every program compiled after {timeout:.0f} s; log {log}")
        time.sleep(1.0)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)  # the group we created: the server and its own children
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
