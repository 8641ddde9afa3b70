"""Tuned launch shapes of the Pallas GEMM kernels, stored per device kind, and the rule that reads them.

`serving.bench.autotune` times each kernel's candidate tiles against its XLA path on a device, for the weight shapes
of a model and a ladder of row counts, and writes one JSON table per device kind (`tuned/<kind>.json`, e.g.
`tuned/nvidia-h200.json`). The serving runtime loads the table of its device (`RuntimeConfig.kernel_tiles`) into the
model's `KernelConfig.tuned`, so `auto` takes the faster implementation of each call and the kernel its tuned tiles.
Nothing is timed while serving.

Lookup (`choose`): among the entries of the call's kernel, weight shape, format and dtype, the one tuned at the
fewest rows >= the call's rows, else the one at the most rows; no entry of that shape: None (the kernel's own rule).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import NamedTuple

TUNED_DIR = Path(__file__).parent / "tuned"
TABLE_VERSION = 1
KERNELS = ("fp8_linear", "moe_gmm")
CHOICE_IMPLS = ("pallas", "xla")


class Tiles(NamedTuple):
    """A Triton launch shape: rows per program (None: the kernel's own rule), output columns per program, input
    chunk per loop step, warps, software-pipeline stages. The defaults are the kernels' untuned first guesses."""

    block_m: int | None = None
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 2

    def kwargs(self) -> dict:
        return self._asdict()


class KernelShape(NamedTuple):
    """One tuned call: the kernel, its rows (tokens), the weight array's shape as stored (fp8_linear [O, I]; moe_gmm
    w1 [E, I, D], MXFP4's packed bytes [E, I, D / 2]), its format ("fp8 32x32", "mxfp4", "bfloat16") and the
    compute dtype (of the MoE's input rows)."""

    kernel: str
    rows: int
    dims: tuple[int, ...]
    weights: str
    dtype: str

    def family(self) -> tuple:
        """The shape without the rows: the entries a lookup chooses among."""
        return self.kernel, tuple(self.dims), self.weights, self.dtype


class KernelChoice(NamedTuple):
    """What `auto` runs for a tuned shape: "pallas" with `tiles`, or "xla"."""

    impl: str
    tiles: Tiles = Tiles()


def check_entry(shape: KernelShape, choice: KernelChoice) -> tuple[KernelShape, KernelChoice]:
    """The entry with plain ints and tuples, or ValueError naming what is wrong."""
    if shape.kernel not in KERNELS:
        raise ValueError(f"tile table: kernel must be one of {KERNELS}, got {shape.kernel!r}")
    if choice.impl not in CHOICE_IMPLS:
        raise ValueError(f"tile table: impl of {shape} must be one of {CHOICE_IMPLS}, got {choice.impl!r}")
    tiles = Tiles(*choice.tiles)
    for name, v in tiles._asdict().items():
        if v is not None and (int(v) != v or v < 1 or (name.startswith("block") and v & (v - 1))):
            raise ValueError(f"tile table: {name} of {shape} must be a positive integer (a power of two for "
                             f"blocks), got {v!r}")
    if int(shape.rows) < 1:
        raise ValueError(f"tile table: rows must be positive, got {shape.rows!r}")
    shape = KernelShape(shape.kernel, int(shape.rows), tuple(int(d) for d in shape.dims), shape.weights, shape.dtype)
    return shape, KernelChoice(choice.impl, tiles)


def choose(tuned: tuple[tuple[KernelShape, KernelChoice], ...], call: KernelShape) -> KernelChoice | None:
    """The tuned choice for `call` (module docstring's rule), or None."""
    same = sorted((s.rows, c) for s, c in tuned if s.family() == call.family())
    if not same:
        return None
    for rows, choice in same:
        if rows >= call.rows:
            return choice
    return same[-1][1]


def device_slug(device_kind: str) -> str:
    """A device kind as a file name: "NVIDIA H200" -> "nvidia-h200"."""
    return re.sub(r"[^a-z0-9]+", "-", device_kind.lower()).strip("-") or "unknown"


def table_path(device_kind: str, directory: Path = TUNED_DIR) -> Path:
    return Path(directory) / f"{device_slug(device_kind)}.json"


def to_json(device_kind: str, entries: list[dict], meta: dict) -> dict:
    """A table document: each entry {"shape": KernelShape fields, "choice": {impl, tiles}, ...measurements}."""
    for e in entries:
        check_entry(KernelShape(**e["shape"]), KernelChoice(e["choice"]["impl"], Tiles(**e["choice"]["tiles"])))
    return {"version": TABLE_VERSION, "device_kind": device_kind, **meta, "entries": entries}


def read(path: Path, device_kind: str | None = None) -> tuple[tuple[KernelShape, KernelChoice], ...]:
    """The (shape, choice) entries of a stored table; ValueError naming the file and the problem when it is not
    one, or when it was tuned on another device kind than `device_kind`."""
    try:
        doc = json.loads(Path(path).read_text())
        if doc.get("version") != TABLE_VERSION:
            raise ValueError(f"version {doc.get('version')!r}, expected {TABLE_VERSION}")
        if device_kind is not None and doc.get("device_kind") != device_kind:
            raise ValueError(f"tuned on {doc.get('device_kind')!r}, not on this {device_kind!r}")
        out = []
        for e in doc["entries"]:
            shape = KernelShape(**{**e["shape"], "dims": tuple(e["shape"]["dims"])})
            out.append(check_entry(shape, KernelChoice(e["choice"]["impl"], Tiles(**e["choice"]["tiles"]))))
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise ValueError(f"tile table {path}: {err}") from None
    if len({s for s, _ in out}) != len(out):
        raise ValueError(f"tile table {path}: a shape is listed twice")
    return tuple(sorted(out, key=lambda entry: entry[0]))


def stored(device_kind: str, directory: Path = TUNED_DIR) -> tuple[tuple[KernelShape, KernelChoice], ...]:
    """The committed table of this device kind, () when none was tuned for it."""
    path = table_path(device_kind, directory)
    return read(path, device_kind) if path.exists() else ()


def for_runtime(setting: str, device_kind: str,
                directory: Path = TUNED_DIR) -> tuple[tuple[KernelShape, KernelChoice], ...]:
    """A runtime's entries from its `kernel_tiles` setting: "stored" the committed table of its device kind (none:
    ()), "none" (), else the path of a table (any device kind: the caller named it)."""
    if setting == "none":
        return ()
    if setting == "stored":
        return stored(device_kind, directory)
    return read(Path(setting))
