"""The real server (`python -m serving.server`) in a subprocess for tests that drive it over HTTP with the official
clients: `serving.bench.server_process` started with the suite's compilation cache and hang guard."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from serving.bench.server_process import REPO_ROOT, free_port, server_process
from tests.conftest import CALLER_XLA_FLAGS, HANG_TIMEOUT_S, TEST_XLA_FLAGS, XLA_CACHE


@contextlib.contextmanager
def running_server(args: list[str], log: Path, env: dict[str, str] | None = None, processes: int = 1
                   ) -> Iterator[str]:
    """The server's base URL while it runs with `args` (a free port and the suite's compilation cache added) in
    `env` (default: this process's); its output goes to `log`, whose tail a start-up failure shows. `processes` > 1:
    one server over that many processes (`serving.launch`, one CPU device each, tensor parallel over them)."""
    port = free_port()
    flags = ["--port", str(port), "--compilation-cache-dir", str(XLA_CACHE), *args]
    cmd = [sys.executable, "-m", "serving.server", *flags]
    env = {**(os.environ if env is None else env), "PYTHONPATH": str(REPO_ROOT)}
    if processes > 1:
        cmd = [sys.executable, "-m", "serving.launch", "--num-processes", str(processes), "--devices-per-process", "1",
               "--", "--tensor-parallel-size", str(processes), *flags]
        env["XLA_FLAGS"] = f"{TEST_XLA_FLAGS} {CALLER_XLA_FLAGS}".strip()  # the launcher sets the device count
    with server_process(cmd, port, log, HANG_TIMEOUT_S, env) as url:
        yield url
