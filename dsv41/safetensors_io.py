"""Safetensors files read with memory maps and `ml_dtypes`, and written, without a framework.

The `safetensors` numpy backend cannot hold BF16 or FP8; the format is simple enough to read directly: an
8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, then the data.
UE8M0 scales (F8_E8M0) are exposed as their raw exponent bytes (uint8).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E8M0": np.dtype(np.uint8), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint file or tensor is malformed; the message names the file and tensor."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    file: Path
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int

    def read(self) -> np.ndarray:
        """A read-only memory-mapped view (no copy until used)."""
        dt = DTYPES[self.dtype]
        count = int(np.prod(self.shape, dtype=np.int64))
        if count == 0:
            return np.zeros(self.shape, dt)
        return np.memmap(self.file, dtype=dt, mode="r", offset=self.offset, shape=self.shape)


def read_header(path: Path) -> dict[str, TensorEntry]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path}: too short to be a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise CheckpointError(f"{path}: header length {n} exceeds the file size")
        try:
            header = json.loads(f.read(n))
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path}: header is not valid JSON ({e})") from e
    entries = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, (start, end) = meta.get("dtype"), tuple(meta.get("shape", ())), meta.get("data_offsets", (0, 0))
        if dtype not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {dtype}")
        nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
        if end - start != nbytes or 8 + n + end > size:
            raise CheckpointError(f"{path}: tensor {name} ({dtype} {list(shape)}) has inconsistent data offsets")
        entries[name] = TensorEntry(name, path, dtype, shape, 8 + n + start, nbytes)
    return entries


def open_checkpoint(folder: str | Path) -> dict[str, TensorEntry]:
    """All tensors of a folder with `model.safetensors.index.json` + shards, or one `model.safetensors`."""
    folder = Path(folder)
    index = folder / INDEX_NAME
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no weight_map")
        entries: dict[str, TensorEntry] = {}
        for file in sorted(set(weight_map.values())):
            shard = read_header(folder / file)
            for name in shard:
                if weight_map.get(name) != file:
                    raise CheckpointError(f"{folder / file}: tensor {name} is not listed for this shard "
                                          f"in {index.name}")
            entries.update(shard)
        missing = sorted(set(weight_map) - set(entries))
        if missing:
            raise CheckpointError(f"{index}: tensor {missing[0]} is listed but absent from {weight_map[missing[0]]}")
        return entries
    single = folder / SINGLE_NAME
    if single.exists():
        return read_header(single)
    raise CheckpointError(f"{folder}: no {INDEX_NAME} and no {SINGLE_NAME}")


def _dtype_name(a: np.ndarray, e8m0: bool) -> str:
    if e8m0:
        return "F8_E8M0"
    for name, dt in DTYPES.items():
        if dt == a.dtype and name != "F8_E8M0":
            return name
    raise CheckpointError(f"cannot store numpy dtype {a.dtype} in safetensors")


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], e8m0_names: set[str] = frozenset(),
                      metadata: dict[str, str] | None = None) -> None:
    """Write `tensors` (names sorted); names in `e8m0_names` are uint8 exponent bytes stored as F8_E8M0."""
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    names = sorted(tensors)
    for name in names:
        a = tensors[name]
        header[name] = {"dtype": _dtype_name(a, name in e8m0_names), "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in names:
            f.write(np.ascontiguousarray(tensors[name]).tobytes())


def write_checkpoint(folder: str | Path, tensors: dict[str, np.ndarray], e8m0_names: set[str] = frozenset(),
                     shard_bytes: int | None = None) -> None:
    """One `model.safetensors`, or shards of about `shard_bytes` plus the index json."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    total = sum(a.nbytes for a in tensors.values())
    if shard_bytes is None or total <= shard_bytes:
        write_safetensors(folder / SINGLE_NAME, tensors, e8m0_names)
        return
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        if size and size + tensors[name].nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += tensors[name].nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(folder / file, shard, e8m0_names & set(shard))
        weight_map.update({name: file for name in shard})
    (folder / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                indent=1, sort_keys=True))
