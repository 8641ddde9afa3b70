"""Engram tables in host memory (serving spec §6): the FP8 rows stay where the checkpoint's files are mapped,
and each step gathers only the rows its hash ids name.

* Mapping: each table is a read-only `np.memmap` of its safetensors bytes - no copy; the OS page cache holds
  one copy per host, shared by every process that maps the file (data-parallel replicas on one node), and
  within a process every model loaded from the same file gets the very same mapping (`_MAPPINGS`).
* Gather (`HostEngramTables.gather`): hash ids [..., L, C] -> `EngramRows` (FP8 bytes [..., L, C, hd] and
  UE8M0 bytes [..., L, C, hd/32]), one worker thread per Engram layer (NumPy's take releases the GIL). A lookup of at least
  `sort_threshold` rows is gathered in table order (ids sorted, rows scattered back): neighbouring rows share
  pages, which keeps page faults and TLB misses down on cold or small-page tables.
* Device memory for Engram is then the step's staging rows only: `staging_bytes(tokens)` per step.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from dsv41.layers.engram import EngramRows
from dsv41.safetensors_io import CheckpointError, TensorEntry

_MAPPINGS: dict[tuple, np.memmap] = {}
_LOCK = threading.Lock()


def shared_mapping(entry: TensorEntry) -> np.ndarray:
    """The process-wide read-only mapping of a tensor's bytes as uint8 [rows, cols]; the same object for every
    caller naming the same bytes."""
    key = (str(Path(entry.file).resolve()), entry.offset, entry.shape, entry.dtype)
    with _LOCK:
        if key not in _MAPPINGS:
            if len(entry.shape) != 2:
                raise CheckpointError(f"Engram table {entry.name} must be 2-D, got shape {list(entry.shape)}")
            _MAPPINGS[key] = np.memmap(entry.file, dtype=np.uint8, mode="r", offset=entry.offset,
                                       shape=(entry.shape[0], entry.nbytes // entry.shape[0]))
        return _MAPPINGS[key]


class HostEngramTables:
    """Per Engram layer (in `engram_layer_ids` order), its FP8 row bytes [rows, hd] and UE8M0 exponent bytes
    [rows, hd/32] in host memory (uint8 arrays: memory maps, or plain arrays for tables built in memory)."""

    def __init__(self, values: list[np.ndarray], scales: list[np.ndarray], *, sort_threshold: int = 32768):
        if len(values) != len(scales) or not values:
            raise ValueError("one values and one scales table per Engram layer")
        for v, s in zip(values, scales):
            if v.dtype != np.uint8 or s.dtype != np.uint8 or v.shape[0] != s.shape[0] or v.shape[1] != 32 * s.shape[1]:
                raise ValueError(f"Engram table bytes {v.dtype}{list(v.shape)} / scales {s.dtype}{list(s.shape)} "
                                 "must be uint8 [rows, hd] and [rows, hd/32]")
        self.values, self.scales = values, scales
        self.head_dim = values[0].shape[1]
        self.sort_threshold = sort_threshold
        self._pool = ThreadPoolExecutor(len(values), thread_name_prefix="engram-gather")

    @classmethod
    def from_checkpoint(cls, entries: dict[str, TensorEntry], layer_ids: tuple[int, ...]) -> HostEngramTables:
        values, scales = [], []
        for lid in layer_ids:
            w, s = f"layers.{lid}.engram.embed.weight", f"layers.{lid}.engram.embed.scale"
            for name, want in ((w, "F8_E4M3"), (s, "F8_E8M0")):
                if name not in entries:
                    raise CheckpointError(f"checkpoint is missing tensor {name} (Engram tables in host memory)")
                if entries[name].dtype not in (want, "U8"):
                    raise CheckpointError(f"tensor {name} must be {want} to stay in host memory, got "
                                          f"{entries[name].dtype} (use engram_cpu_offload=False)")
            values.append(shared_mapping(entries[w]))
            scales.append(shared_mapping(entries[s]))
        return cls(values, scales)

    @property
    def nbytes(self) -> int:
        """Host bytes of the tables."""
        return sum(v.nbytes + s.nbytes for v, s in zip(self.values, self.scales))

    def row_bytes(self) -> int:
        return self.head_dim + self.head_dim // 32

    def staging_bytes(self, tokens: int, hash_cols: int) -> int:
        """Device bytes of one step's gathered rows for `tokens` rows."""
        return tokens * len(self.values) * hash_cols * self.row_bytes()

    def _gather_layer(self, i: int, ids: np.ndarray, out_v: np.ndarray, out_s: np.ndarray) -> None:
        """Rows of layer i's ids [..., C] into out_v [..., L, C, hd] / out_s [..., L, C, hd/32] at layer i."""
        if ids.size >= self.sort_threshold:  # table order: one pass over the table's pages
            flat = ids.reshape(-1)
            order = np.argsort(flat, kind="stable")
            v = np.empty((flat.size, self.values[i].shape[1]), np.uint8)
            s = np.empty((flat.size, self.scales[i].shape[1]), np.uint8)
            v[order] = np.take(self.values[i], flat[order], axis=0)
            s[order] = np.take(self.scales[i], flat[order], axis=0)
            out_v[..., i, :, :] = v.reshape(*ids.shape, -1)
            out_s[..., i, :, :] = s.reshape(*ids.shape, -1)
        else:
            out_v[..., i, :, :] = np.take(self.values[i], ids, axis=0)
            out_s[..., i, :, :] = np.take(self.scales[i], ids, axis=0)

    def gather(self, hash_ids: np.ndarray, valid: np.ndarray | None = None) -> EngramRows:
        """Rows of hash ids [..., L, C] (int) -> EngramRows of NumPy uint8 arrays [..., L, C, hd(/32)].

        `valid` (bool over the leading dims, e.g. a step's real rows [T]): only those rows are gathered, the
        others (a bucket's padding) are zeros."""
        ids = np.asarray(hash_ids)
        if ids.shape[-2] != len(self.values):
            raise ValueError(f"hash ids {list(ids.shape)}: expected {len(self.values)} Engram layers on axis -2")
        if valid is not None and not np.all(valid):
            rows = self.gather(ids[valid])
            out_v = np.zeros((*ids.shape, self.head_dim), np.uint8)
            out_s = np.zeros((*ids.shape, self.head_dim // 32), np.uint8)
            out_v[valid], out_s[valid] = rows.values, rows.scales
            return EngramRows(out_v, out_s)
        # Fresh buffers each step: an asynchronously dispatched step may still read the previous ones (and
        # a CPU device may alias host memory instead of copying it).
        out_v = np.empty((*ids.shape, self.head_dim), np.uint8)
        out_s = np.empty((*ids.shape, self.head_dim // 32), np.uint8)
        futures = [self._pool.submit(self._gather_layer, i, ids[..., i, :], out_v, out_s)
                   for i in range(len(self.values))]
        for f in futures:
            f.result()
        return EngramRows(out_v, out_s)
