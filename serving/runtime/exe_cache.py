"""Compiled step programs on disk, so a restart skips tracing and lowering as well as compiling.

JAX's persistent cache is keyed by the lowered program, so a warm start still traces and lowers every segment
before it can look one up, which is most of a warm start once the programs load (docs/design/measurements.md). This
cache is keyed by what determines a program before it is traced - the project's model and runtime source, the jax /
jaxlib / flax versions, the backend and its devices, XLA_FLAGS, the config, the runtime settings, the cache layout,
the parameter tree - and, per program, the bucket and the argument tree it is called with; a program whose stored
argument tree differs from the call's is not used.
vLLM keys its torch.compile cache the same way (source hash + config).

The folder is bounded (`max_bytes`, like JAX's `jax_compilation_cache_max_size`): after each write the least
recently used files (a load counts as a use) are deleted until the rest fit, so programs of old source versions
and configs do not pile up.

A runner keeps its programs here when it is given `ExecutableCacheSettings` (the server's default, in
`--compilation-cache-dir`/executables), and then JAX's own persistent cache stays off: on jaxlib 0.12 a program that
came out of JAX's cache serializes without its code (it loads, then fails with "Function ... not found"), so the two
are not mixed in one process. A mesh runner's programs carry
their shardings and load onto the mesh's devices in its order (the mesh's shape and device ids are in the key);
a mesh server's warm start skips tracing like a one-device one (docs/benchmarks/startup.md). Each process of a
server on several processes (`serving.engine.multiprocess`) keeps its own programs (the process index is in the
key: a program binds its process's devices), so the processes of one machine can share a folder.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import jax
from jax.experimental import serialize_executable

DEFAULT_MAX_BYTES = 8 << 30
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "dsv41-jax" / "xla"  # the server's and LLM's (programs in executables/)


@dataclass(frozen=True)
class ExecutableCacheSettings:
    """Where a runner keeps its compiled programs, and at most how many bytes of them (None: no bound)."""

    folder: Path
    max_bytes: int | None = DEFAULT_MAX_BYTES

    @classmethod
    def in_cache_dir(cls, cache_dir: str | Path | None, max_bytes: int | None = DEFAULT_MAX_BYTES):
        """The settings of a `--compilation-cache-dir` (programs in its executables/); None for '' or None."""
        return cls(Path(cache_dir) / "executables", max_bytes) if cache_dir else None

    @property
    def tuning_file(self) -> Path:
        """Where runners keep their MoE small-step choices (`serving.runtime.moe_tuning`): beside the programs
        compiled with them."""
        return Path(self.folder) / "moe_small_steps.json"


# the packages whose code becomes the step programs (the server, engine and API only call them)
_TRACED_PACKAGES = ("dsv41", "pallas_kernels", "serving/runtime", "sharding")
_JAX_OPTIONS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_default_prng_impl",
                "jax_threefry_partitionable", "jax_numpy_rank_promotion", "jax_use_shardy_partitioner")


@functools.cache
def _environment() -> str:
    """What every program depends on beyond its own arguments, hashed once per process."""
    import flax
    import jaxlib
    import numpy

    h = hashlib.sha256()
    root = Path(__file__).resolve().parents[2]
    for package in _TRACED_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    devices = [(d.platform, d.device_kind) for d in jax.devices()]
    options = [(name, getattr(jax.config, name, None)) for name in _JAX_OPTIONS]
    h.update(repr((sys.version, jax.__version__, jaxlib.__version__, flax.__version__, numpy.__version__,
                   jax.default_backend(),
                   devices, jax.process_count(), jax.process_index(), os.environ.get("XLA_FLAGS", ""),
                   options)).encode())
    return h.hexdigest()


def arg_tree(args) -> str:
    """The argument tree as a program sees it: structure, shapes, dtypes, shardings."""
    leaves, treedef = jax.tree.flatten(args)
    return repr((treedef, [(a.shape, str(a.dtype), getattr(a, "weak_type", False), a.sharding) for a in leaves]))


class ExecutableCache:
    """One runner's programs (`load` / `save` per bucket) and picklable values (`get_value` / `put_value`: the
    segment carry's shapes, found by tracing otherwise), under a key of what determines them (`runner_state`: the
    runner described). Anything unreadable is a miss: rebuilt, overwritten."""

    def __init__(self, settings: ExecutableCacheSettings, runner_state: str):
        self.folder, self.max_bytes = Path(settings.folder), settings.max_bytes
        self._prefix = hashlib.sha256((_environment() + runner_state).encode()).hexdigest()[:32]
        self.hits = self.misses = 0

    def _path(self, name: str) -> Path:
        return self.folder / f"{self._prefix}-{hashlib.sha256(name.encode()).hexdigest()[:32]}.pkl"

    def _read(self, name: str):
        path = self._path(name)
        try:
            value = pickle.loads(path.read_bytes())
        except Exception:  # absent, damaged, or of classes that changed since: a cache miss, never an error
            return None
        try:
            os.utime(path)  # a use: the least recently used files go first
        except OSError:  # e.g. a read-only folder, or evicted meanwhile by another process: still a hit
            pass
        return value

    def _write(self, name: str, value) -> None:
        """Store `value`; a folder that cannot be written (read-only, full, not a folder) warns and keeps nothing:
        the cache never stops a runner."""
        tmp = None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                pickle.dump(value, f)
            os.replace(tmp, self._path(name))  # atomic: a concurrent reader sees the old file or the new one
        except OSError as e:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            warnings.warn(f"executable cache {self.folder}: not written ({e})", stacklevel=3)
            return
        if self.max_bytes is not None:
            evict(self.folder, self.max_bytes)

    def get_value(self, name: str):
        return self._read(f"value {name}")

    def put_value(self, name: str, value) -> None:
        self._write(f"value {name}", value)

    def load(self, key, specs: tuple, devices: list):
        """The compiled program of bucket `key` for arguments `specs`, loaded onto `devices` (those it was
        compiled for: by default a program loads onto every local device), or None."""
        entry = self._read(f"program {key!r} {arg_tree(specs)}")
        if entry is not None:
            payload, in_tree, out_tree = entry
            if in_tree == jax.tree.structure((specs, {})):
                try:
                    exe = serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                                    execution_devices=devices)
                except Exception:  # a damaged payload: compiled again and overwritten
                    exe = None
                if exe is not None:
                    self.hits += 1
                    return exe
        self.misses += 1
        return None

    def save(self, key, specs: tuple, compiled) -> None:
        if jax.config.jax_compilation_cache_dir and jax.config.jax_enable_compilation_cache:
            warnings.warn("no program is kept in the executable cache: JAX's persistent compilation cache is on in "
                          "this process, and a program it served serializes without its code on jaxlib 0.12",
                          stacklevel=2)  # one message for every program: shown once
            return
        try:
            entry = serialize_executable.serialize(compiled)
        except (ValueError, NotImplementedError) as e:  # e.g. a program closing over device arrays
            warnings.warn(f"bucket {key} not kept in the executable cache: {e}", stacklevel=2)
            return
        self._write(f"program {key!r} {arg_tree(specs)}", entry)


def evict(folder: Path, max_bytes: int) -> None:
    """Delete the least recently used entries of `folder` until the rest hold at most `max_bytes`. Files another
    process deletes meanwhile are skipped (it holds the same bound)."""
    entries = []
    for path in folder.glob("*.pkl"):
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        entries.append((st.st_mtime_ns, st.st_size, path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries, key=lambda e: e[0]):
        if total <= max_bytes:
            break
        path.unlink(missing_ok=True)
        total -= size
