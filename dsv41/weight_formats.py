"""Which weights stay on the device in the release's formats (spec §6.1), and in which.

A `Formats` maps a module path to its stored format:
  ("fp8", (b0, b1))  a `Linear` kept as e4m3 values + UE8M0 exponent bytes per b0 x b1 block
  ("mxfp4",)         a MoE's routed `Experts` kept as packed e2m1 bytes + UE8M0 exponent bytes per 32
  ("host",)          an Engram table kept in host memory (`dsv41.engram_host`), not a device parameter

It is read off a checkpoint (the tensors stored that way: FP8 attention / shared-expert / Engram-wkv /
DSpark main_proj linears and MXFP4 experts in the release) or off a parameter dict (the dtypes say it),
and `apply` turns the modules of a freshly built (abstract) model into those formats, so the parameter
tree holds the checkpoint's bytes and every use decodes what it reads. A tensor stored any other way (BF16,
F32, FP8 experts, which no release has) is decoded to the compute dtype at load, as before.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
from flax import nnx

from dsv41.config import ModelConfig
from dsv41.safetensors_io import CheckpointError, TensorEntry

Formats = dict[tuple, tuple]
_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
_BLOCKS = ((32, 32), (128, 128), (64, 64))


def weight_block(c: ModelConfig, name: str, w_shape: tuple, s_shape: tuple) -> tuple[int, int]:
    """The FP8 block of a weight from its scale's shape: the config's `weight_block_size`, else the first of
    32 x 32 (V4.1), 128 x 128 (V4), 64 x 64 whose grid matches."""
    wbs = (c.quantization or {}).get("weight_block_size")
    candidates = [tuple(wbs)] if wbs else list(_BLOCKS)
    for b in candidates:
        if tuple(s_shape) == (-(-w_shape[0] // b[0]), -(-w_shape[1] // b[1])):
            return b
    raise CheckpointError(f"tensor {name}.scale has shape {list(s_shape)}, which matches no FP8 block size "
                          f"{candidates} for weight shape {list(w_shape)}")


def _is_engram_table(module_path: tuple) -> bool:
    return module_path[-1] == "embed" and len(module_path) > 1 and module_path[-2] == "engram"


def from_checkpoint(c: ModelConfig, entries: dict[str, TensorEntry], targets: dict) -> Formats:
    """Formats of the tensors a checkpoint stores quantized; `targets` = `checkpoint.release_names` of the
    float model's parameters."""
    out: Formats = {}
    for name, t in targets.items():
        e = entries.get(name)
        module = t.path[:-1]
        if e is None or _is_engram_table(module):
            continue
        scale = entries.get(name[: -len(".weight")] + ".scale")
        if t.expert is not None:
            if e.dtype == "I8" and t.expert == 0 and scale is not None:
                out[module] = ("mxfp4",)
        elif e.dtype == "F8_E4M3" and scale is not None and len(e.shape) == 2:
            out[module] = ("fp8", weight_block(c, name, e.shape, scale.shape))
    return out


def of_params(c: ModelConfig, params: dict[tuple, object]) -> Formats:
    """Formats of a parameter dict built for them (an FP8 Linear's `weight` is e4m3 beside a `scale`; quantized
    experts have `w1_scale`)."""
    out: Formats = {}
    for path, a in params.items():
        module = path[:-1]
        if path[-1] == "weight" and np.dtype(a.dtype) == _E4M3 and not _is_engram_table(module):
            out[module] = ("fp8", weight_block(c, ".".join(map(str, path)), a.shape, params[module + ("scale",)].shape))
        elif path[-1] == "w1_scale":
            out[module] = ("mxfp4",)
    return out


def _module_at(root: nnx.Module, path: tuple) -> nnx.Module:
    m = root
    for p in path:
        m = m[p] if isinstance(p, int) else getattr(m, p)
    return m


def apply(module: nnx.Module, formats: Formats) -> nnx.Module:
    """Switch each named module to its stored format (call on a freshly built or abstract model)."""
    for path, fmt in formats.items():
        m = _module_at(module, path)
        if fmt[0] == "fp8":
            m.store_fp8(fmt[1])
        elif fmt[0] == "mxfp4":
            m.store_mxfp4()
        elif fmt[0] == "host":
            m.store_on_host()
        else:
            raise ValueError(f"unknown weight format {fmt!r} for {'.'.join(map(str, path))}")
    return module


def to_json(formats: Formats) -> list:
    return [[list(p), list(f[:1]) + [list(x) for x in f[1:]]] for p, f in sorted(formats.items(), key=str)]


def from_json(items: list) -> Formats:
    return {tuple(p): (f[0], *[tuple(x) for x in f[1:]]) for p, f in items}


def logical_size(path: tuple, a) -> int:
    """Parameters a stored tensor holds: a packed MXFP4 byte holds two, scale bytes count none."""
    leaf = str(path[-1])
    if leaf.endswith("_scale") or (leaf == "scale" and np.dtype(a.dtype) == np.uint8):
        return 0
    n = math.prod(a.shape)
    return 2 * n if leaf in ("w1", "w2", "w3") and np.dtype(a.dtype) == np.uint8 else n
