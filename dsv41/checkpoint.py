"""Release checkpoint layout <-> model parameters (spec §6).

Every tensor of a checkpoint is classified: a model parameter (possibly one expert of a stacked [E, ...]
parameter), the `.scale` companion of an FP8 / MXFP4 weight, or a tensor a text-only model skips on
purpose (vision tower, image embeddings, `gate.bias_vl`, V4's classic MTP, DSpark stages when
`num_nextn_predict_layers` is 0). Anything else is an error naming the tensor, as is a missing one.
Tensors the device keeps in their release format (`weight_formats`: FP8 linears, MXFP4 experts, the FP8
Engram table) are read as stored; the rest is decoded to the compute dtype on the host one tensor at a time.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dsv41 import quant
from dsv41.config import ModelConfig
from dsv41.safetensors_io import (
    CheckpointError,
    TensorEntry,
    open_checkpoint,
    write_checkpoint,
)
from dsv41.weight_formats import weight_block

Path_ = tuple  # a parameter path in the NNX state, e.g. ("layers", 3, "attn", "wq_a", "weight")

# Linears stored as FP8 with UE8M0 block scales in the release (the rest is BF16 / F32).
_FP8_LINEARS = re.compile(r"(\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|\.engram\.wkv|"
                          r"\.ffn\.shared_experts\.w[123]|^mtp\.0\.main_proj)\.weight$")
_F32_TENSORS = re.compile(r"(hc_(attn|ffn|head)_(fn|base|scale)|\.attn_sink|\.gate\.bias|\.ape|"
                          r"confidence_head\.proj\.weight)$")
_TEXT_ONLY_SKIPS = re.compile(r"^(vision\.|aligner\.|image_(start|end|newline))|\.ffn\.gate\.bias_vl$")
_EXPERT = re.compile(r"^(.*)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")


@dataclass(frozen=True)
class Target:
    path: Path_
    expert: int | None = None  # index into a stacked [E, ...] parameter


def _block_names(prefix: str, rest: Path_, n_experts: int) -> list[tuple[str, Target]]:
    if rest[0] in ("hc_attn", "hc_ffn"):
        return [(f"{prefix}{rest[0]}_{rest[1]}", None)]
    if rest[:2] == ("ffn", "experts"):  # w1 or its MXFP4 exponents w1_scale -> experts.e.w1.weight / .scale
        w, _, leaf = rest[2].partition("_")
        return [(f"{prefix}ffn.experts.{e}.{w}.{leaf or 'weight'}", e) for e in range(n_experts)]
    return [(prefix + ".".join(str(p) for p in rest), None)]


def release_names(c: ModelConfig, paths: list[Path_]) -> dict[str, Target]:
    """Release tensor name -> parameter target, for every parameter path of the model."""
    last = c.num_nextn_predict_layers - 1
    dspark_heads = {"main_proj": "mtp.0.main_proj.weight", "main_norm": "mtp.0.main_norm.weight",
                    "norm": f"mtp.{last}.norm.weight", "markov_embed": f"mtp.{last}.markov_head.embed.weight",
                    "markov_head": f"mtp.{last}.markov_head.head.weight",
                    "confidence": f"mtp.{last}.confidence_head.proj.weight"}
    out: dict[str, Target] = {}
    for path in paths:
        head = path[0]
        if head == "layers":
            names = _block_names(f"layers.{path[1]}.", path[2:], c.n_routed_experts)
        elif head == "dspark" and path[1] == "blocks":
            names = _block_names(f"mtp.{path[2]}.", path[3:], c.dspark_n_routed_experts)
        elif head == "dspark":  # a head's weight, or the FP8 scale of main_proj
            names = [(dspark_heads[path[1]].removesuffix("weight") + str(path[-1]), None)]
        elif head == "hc_head":
            names = [(f"hc_head_{path[1]}", None)]
        else:
            names = [(".".join(str(p) for p in path), None)]
        for name, expert in names:
            out[name] = Target(path, expert)
    return out


def _skip_reason(name: str, c: ModelConfig) -> str | None:
    if _TEXT_ONLY_SKIPS.search(name):
        return "vision / image tensor (text-only model)"
    if name.startswith("mtp."):
        if c.family == "v4":
            return "V4 multi-token-prediction layer (not implemented)"
        if c.num_nextn_predict_layers == 0:
            return "DSpark stage, num_nextn_predict_layers is 0"
    return None


def decode_tensor(c: ModelConfig, name: str, entry: TensorEntry, entries: dict[str, TensorEntry],
                  target_dtype: np.dtype) -> np.ndarray:
    """A checkpoint tensor as a NumPy array of `target_dtype` (dequantizing FP8 / MXFP4 weights)."""
    raw = entry.read()
    if target_dtype == np.dtype(ml_dtypes.float8_e4m3fn) or target_dtype == np.dtype(np.uint8):
        # Kept as stored (weight_formats): e4m3 values, UE8M0 exponent bytes, packed MXFP4 bytes.
        if target_dtype != np.dtype(np.uint8):
            want = ("F8_E4M3",)
        else:
            want = ("F8_E8M0", "U8") if name.endswith(".scale") else ("I8",)
        if entry.dtype not in want:
            raise CheckpointError(f"tensor {name} must be {' or '.join(want)}, got {entry.dtype}")
        raw = np.asarray(raw)
        return raw.view(np.uint8) if target_dtype == np.dtype(np.uint8) else raw
    if entry.dtype in ("F8_E4M3", "I8") and not np.issubdtype(target_dtype, np.integer):
        scale_name = name[: -len(".weight")] + ".scale" if name.endswith(".weight") else name + ".scale"
        if scale_name not in entries:
            raise CheckpointError(f"tensor {name} is {entry.dtype} but the checkpoint has no {scale_name}")
        scale = entries[scale_name].read()
        if entry.dtype == "I8":
            return quant.dequantize_mxfp4(np.asarray(raw), np.asarray(scale)).astype(target_dtype)
        block = weight_block(c, name, entry.shape, tuple(scale.shape))
        return quant.dequantize_fp8_blocks(np.asarray(raw), np.asarray(scale), block).astype(target_dtype)
    if np.issubdtype(target_dtype, np.integer) != (entry.dtype in ("I64", "I32", "I16", "I8", "U8")):
        kind = "an integer" if np.issubdtype(target_dtype, np.integer) else "a floating-point"
        raise CheckpointError(f"tensor {name} must be {kind} tensor, got {entry.dtype}")
    return np.asarray(raw).astype(target_dtype)


def classify(c: ModelConfig, entries: dict[str, TensorEntry], targets: dict[str, Target],
             elsewhere: frozenset[str] = frozenset()) -> tuple[dict[str, Target], dict[str, str]]:
    """Split checkpoint names into parameters and skipped tensors (with reasons); raise on unknown/missing.
    `elsewhere`: names read by another path (Engram tables in host memory)."""
    params: dict[str, Target] = {}
    skipped: dict[str, str] = {}
    unknown: list[str] = []
    for name in sorted(entries):
        weight = entries.get(name[: -len(".scale")] + ".weight") if name.endswith(".scale") else None
        if name in targets:
            params[name] = targets[name]
        elif name in elsewhere:
            skipped[name] = "held in host memory"
        elif (reason := _skip_reason(name, c)) is not None:
            skipped[name] = reason
        elif weight is not None and weight.dtype in ("F8_E4M3", "I8"):
            skipped[name] = "scale of " + weight.name
        else:
            unknown.append(name)
    missing = sorted(set(targets) - set(params))
    if missing:  # reported first: an orphaned `.scale` is a symptom of its missing weight
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint is missing tensor {missing[0]}{more}")
    if unknown:
        e = entries[unknown[0]]
        raise CheckpointError(f"unknown tensor {e.name} ({e.dtype} {list(e.shape)}) for this {c.family} config")
    return params, skipped


def load_params(folder: str | Path, c: ModelConfig, abstract: dict[Path_, jax.ShapeDtypeStruct],
                elsewhere: frozenset[str] = frozenset(), *, shardings: Callable | None = None,
                progress: bool = False) -> tuple[dict[Path_, jax.Array], dict[str, str]]:
    """Read every parameter of the abstract state from a release checkpoint; returns device arrays.

    `elsewhere`: tensor names another path reads (host-resident Engram tables). `shardings(path, shape)`: the
    parameter's sharding - each device then receives only its own index range of each tensor, read from the
    memory-mapped files (an expert stack reads only the experts of the range), so host memory holds about one
    tensor at a time, never the checkpoint. `progress`: a bar of tensors and bytes on stderr."""
    entries = open_checkpoint(folder)
    targets = release_names(c, list(abstract))
    params, skipped = classify(c, entries, targets, elsewhere)
    by_path: dict[Path_, list[tuple[str, Target]]] = {}
    for name, t in params.items():
        by_path.setdefault(t.path, []).append((name, t))
    bar = _LoadProgress(len(params), sum(entries[n].nbytes for n in params)) if progress else None
    out = {}
    for path, items in by_path.items():
        spec = abstract[path]
        dtype = np.dtype(spec.dtype)

        def read(name: str, t: Target, index: tuple = ()) -> np.ndarray:
            a = decode_tensor(c, name, entries[name], entries, dtype)
            want = spec.shape[1:] if t.expert is not None else spec.shape
            if a.shape != tuple(want):
                raise CheckpointError(f"tensor {name} has shape {list(a.shape)}, the config needs {list(want)}")
            return np.ascontiguousarray(a[index])

        if items[0][1].expert is not None:
            by_expert = sorted(items, key=lambda it: it[1].expert)

            def block(index: tuple, by_expert=by_expert, read=read) -> np.ndarray:
                index = index or (slice(None),) * len(spec.shape)
                return np.stack([read(n, t, index[1:]) for n, t in by_expert[index[0]]])
        else:
            (name, t), = items
            whole = []  # one read, shared by every device asking (e.g. a replicated tensor)

            def block(index: tuple, name=name, t=t, read=read, whole=whole) -> np.ndarray:
                if not whole:
                    whole.append(read(name, t))
                return whole[0][index]
        if shardings is None:
            out[path] = jnp.asarray(block(()))
        else:
            out[path] = jax.make_array_from_callback(tuple(spec.shape), shardings(path, tuple(spec.shape)), block)
        if bar:
            bar.update(len(items), sum(entries[n].nbytes for n, _ in items))
    return out, skipped


class _LoadProgress:
    """Tensors and bytes read so far, on one stderr line."""

    def __init__(self, tensors: int, nbytes: int):
        self.total, self.total_bytes, self.done, self.bytes, self.t0 = tensors, nbytes, 0, 0, time.perf_counter()
        self.shown = 0.0

    def update(self, tensors: int, nbytes: int) -> None:
        self.done, self.bytes = self.done + tensors, self.bytes + nbytes
        now = time.perf_counter()
        if self.done < self.total and now - self.shown < 0.5:  # a redraw every half second is enough
            return
        self.shown = now
        fill = int(24 * self.bytes / max(self.total_bytes, 1))
        sys.stderr.write(f"\r[{'#' * fill}{'.' * (24 - fill)}] loading {self.done}/{self.total} tensors, "
                         f"{self.bytes / 2**30:.2f}/{self.total_bytes / 2**30:.2f} GiB "
                         f"{time.perf_counter() - self.t0:6.1f}s")
        if self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def release_formats(c: ModelConfig, paths: list[Path_]) -> dict[Path_, tuple]:
    """The `weight_formats.Formats` of the release checkpoint of `c`, from the float model's parameter paths:
    FP8 linears in the config's blocks, MXFP4 routed experts (what `export_tensors(quantize=True)` writes)."""
    block = tuple(release_quantization(c)["weight_block_size"])
    out: dict[Path_, tuple] = {}
    for name, t in release_names(c, paths).items():
        if t.expert is not None:
            out[t.path[:-1]] = ("mxfp4",)
        elif _FP8_LINEARS.search(name):
            out[t.path[:-1]] = ("fp8", block)
    return out


def release_quantization(c: ModelConfig) -> dict:
    """The config's quantization_config, or the release's for its family (FP8 32x32 V4.1, 128x128 V4)."""
    block = [32, 32] if c.family == "v41" else [128, 128]
    return c.quantization or {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": block,
                              "scale_fmt": "ue8m0", "expert_dtype": "fp4"}


def export_tensors(c: ModelConfig, params: dict[Path_, np.ndarray], *, quantize: bool
                   ) -> tuple[dict[str, np.ndarray], set[str]]:
    """Parameters -> release tensors. `quantize` writes the release formats (FP8 block linears, MXFP4
    experts, FP8 Engram rows, BF16 elsewhere, F32 for mHC/sinks/biases); otherwise each parameter in its
    own dtype with no scales. Returns (tensors, names of UE8M0 scale tensors)."""
    block = tuple(release_quantization(c)["weight_block_size"])
    tensors: dict[str, np.ndarray] = {}
    e8m0: set[str] = set()
    for name, t in release_names(c, list(params)).items():
        a = np.asarray(params[t.path])
        a = a[t.expert] if t.expert is not None else a
        if np.issubdtype(a.dtype, np.integer) or a.dtype == ml_dtypes.float8_e4m3fn:  # already in release format
            if name.endswith(".scale") and a.dtype == np.uint8:
                e8m0.add(name)
            elif a.dtype == np.uint8:  # packed MXFP4 experts: I8 in the release
                a = a.view(np.int8)
            tensors[name] = a
        elif not quantize:
            tensors[name] = a
        elif t.expert is not None:
            tensors[name], tensors[name[:-7] + ".scale"] = quant.quantize_mxfp4(a.astype(np.float32))
            e8m0.add(name[:-7] + ".scale")
        elif _FP8_LINEARS.search(name):
            tensors[name], tensors[name[:-7] + ".scale"] = quant.quantize_fp8_blocks(a.astype(np.float32), block)
            e8m0.add(name[:-7] + ".scale")
        elif name.endswith("engram.embed.weight"):
            tensors[name], tensors[name[:-7] + ".scale"] = quant.quantize_fp8_blocks(a.astype(np.float32), (1, 32))
            e8m0.add(name[:-7] + ".scale")
        elif _F32_TENSORS.search(name):
            tensors[name] = a.astype(np.float32)
        else:
            tensors[name] = a.astype(ml_dtypes.bfloat16)
    return tensors, e8m0


def save_checkpoint(folder: str | Path, c: ModelConfig, params: dict[Path_, np.ndarray], *, quantize: bool,
                    shard_bytes: int | None = None) -> None:
    """Write config.json and the release safetensors layout for `params` (NNX state paths -> arrays)."""
    import json

    folder = Path(folder)
    tensors, e8m0 = export_tensors(c, params, quantize=quantize)
    write_checkpoint(folder, tensors, e8m0, shard_bytes)
    cfg = c.replace(quantization=release_quantization(c) if quantize else None)
    (folder / "config.json").write_text(json.dumps(cfg.to_release_dict(), indent=1))
