"""The real server (`python -m serving.server`) in a subprocess for tests that drive it over HTTP with the official
clients: `serving.bench.server_process` started with the suite's compilation cache and hang guard."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from serving.bench.server_process import REPO_ROOT, free_port, server_process
from tests.conftest import HANG_TIMEOUT_S, XLA_CACHE


@contextlib.contextmanager
def running_server(args: list[str], log: Path) -> Iterator[str]:
    """The server's base URL while it runs with `args` (a free port and the suite's compilation cache added); its
    output goes to `log`, whose tail a start-up failure shows."""
    port = free_port()
    cmd = [sys.executable, "-m", "serving.server", "--port", str(port), "--compilation-cache-dir", str(XLA_CACHE),
           *args]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    with server_process(cmd, port, log, HANG_TIMEOUT_S, env) as url:
        yield url
