"""`jax.profiler` traces of a running engine, started and stopped on demand (the server's `/start_profile` and
`/stop_profile`, the benchmarks' `--profile-dir`).

A trace goes to `DIR/plugins/profile/<session>/`, the layout TensorBoard / XProf read (`<host>.xplane.pb`), with
`<host>.trace.json.gz` and `perfetto_trace.json.gz` beside it for Perfetto. Each trace gets a session folder of its
own, so the files of one trace are known exactly (two traces in the same second would otherwise share JAX's
timestamp-named folder and overwrite each other).
"""

from __future__ import annotations

import contextlib
import re
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import jax


class ProfilerError(RuntimeError):
    """The profiler was misused: no folder configured, a trace already running, or none running."""


@dataclass(frozen=True)
class Trace:
    """One finished trace: its session folder and the files in it."""

    folder: Path

    @property
    def files(self) -> list[Path]:
        return sorted(p for p in self.folder.iterdir() if p.is_file())

    def file(self, suffix: str) -> Path | None:
        return next((p for p in self.files if p.name.endswith(suffix)), None)

    @property
    def xplane(self) -> Path | None:
        return self.file(".xplane.pb")

    @property
    def perfetto(self) -> Path | None:
        return self.file("perfetto_trace.json.gz")

    def describe(self) -> dict:
        return {"trace_dir": str(self.folder), "xplane": _str(self.xplane), "perfetto_trace": _str(self.perfetto),
                "files": [p.name for p in self.files]}


class Profiler:
    """Starts and stops traces into `profile_dir` (None: profiling is off and `start` says which flag turns it
    on). JAX runs one trace per process; the calls block (the export writes the files), so a server runs them off
    its event loop."""

    def __init__(self, profile_dir: str | Path | None, *, flag: str = "--profile-dir"):
        self.profile_dir = Path(profile_dir).absolute() if profile_dir is not None else None
        self.flag = flag
        self._lock = threading.Lock()
        self._session: Path | None = None
        self.last: Trace | None = None

    @property
    def active(self) -> bool:
        return self._session is not None

    def start(self, label: str = "") -> Path:
        """Start a trace; the session folder it will be written to (its name: the time, then `label`, which
        TensorBoard shows as the run's name)."""
        with self._lock:
            self._check_on()
            if self._session is not None:
                raise ProfilerError(f"a trace is already running (into {self._session}); stop it first")
            name = self._session_name(label)
            options = jax.profiler.ProfileOptions()
            options.session_id = name
            try:
                jax.profiler.start_trace(self.profile_dir, create_perfetto_trace=True, profiler_options=options)
            except RuntimeError as e:  # someone else in this process holds JAX's one trace
                raise ProfilerError(f"cannot start a trace: {e}") from e
            self._session = self.profile_dir / "plugins" / "profile" / name
            return self._session

    def stop(self) -> Trace:
        """Stop the running trace and write its files."""
        with self._lock:
            self._check_on()
            if self._session is None:
                raise ProfilerError("no trace is running; start one first")
            folder, self._session = self._session, None
            jax.profiler.stop_trace()
            self.last = Trace(folder)
            return self.last

    def _check_on(self) -> None:
        if self.profile_dir is None:
            raise ProfilerError(f"profiling is off: no {self.flag} DIR was given, so there is nowhere to write "
                                "a trace")

    def _session_name(self, label: str) -> str:
        stamp = time.strftime("%Y_%m_%d_%H_%M_%S") + f"_{time.time_ns() // 1_000_000 % 1000:03d}"
        if label:
            stamp += "_" + re.sub(r"[^A-Za-z0-9_.-]+", "_", label)
        name, n = stamp, 1
        while (self.profile_dir / "plugins" / "profile" / name).exists():
            n += 1
            name = f"{stamp}_{n}"
        return name


@contextlib.contextmanager
def profiling(profile_dir: str | Path | None, label: str = "") -> Iterator[Profiler | None]:
    """Trace the body into `profile_dir` and say where the trace went (stderr); None: do nothing. The profiler's
    `last` is the trace once the body is done."""
    if profile_dir is None:
        yield None
        return
    profiler = Profiler(profile_dir)
    profiler.start(label)
    try:
        yield profiler
    finally:
        trace = profiler.stop()
        print(f"profile: {label + ': ' if label else ''}trace written to {trace.folder}", file=sys.stderr, flush=True)


def _str(p: Path | None) -> str | None:
    return None if p is None else str(p)
