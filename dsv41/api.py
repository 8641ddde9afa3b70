"""The public entry points: `load` a release checkpoint (or build a random model) into a `Model`.

The model is built abstractly (`nnx.eval_shape`, nothing allocated), then its parameters are filled from
the checkpoint one tensor at a time. `Model.logits` calls one `jax.jit` function over the flattened
parameter leaves (the graph definition is static), so repeated calls pay no NNX dispatch cost.
"""

from __future__ import annotations

import copy
import functools
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from dsv41 import checkpoint, converted, weight_formats
from dsv41.config import ModelConfig, load_config
from dsv41.engram_host import HostEngramTables
from dsv41.init import random_params, random_release_params
from dsv41.layers.engram import EngramLayout, build_compressed_token_map
from dsv41.layers.basic import with_kernels
from dsv41.model import Transformer, forward, published_rows
from dsv41.safetensors_io import CheckpointError, open_checkpoint
from pallas_kernels.kernel_config import KernelConfig

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def abstract_params(c: ModelConfig, dtype=jnp.float32, engram_fp8: bool = False,
                    formats: weight_formats.Formats | None = None
                    ) -> tuple[nnx.GraphDef, dict[tuple, jax.ShapeDtypeStruct]]:
    """Graph definition and {path: ShapeDtypeStruct} of every parameter, without allocating; `formats` keeps
    those modules' weights in their release formats (`dsv41.weight_formats`)."""
    abstract = nnx.eval_shape(lambda: weight_formats.apply(Transformer(c, dtype=dtype, engram_fp8=engram_fp8),
                                                           formats or {}))
    graphdef, state = nnx.split(abstract)
    flat = {tuple(k): v.get_value() for k, v in nnx.to_flat_state(state)}
    return graphdef, flat


def _has_fp8_engram_table(paths) -> bool:
    return any(tuple(p)[-2:] == ("embed", "scale") for p in paths)


def fp8_engram_tables(folder: str | Path) -> bool:
    """Whether a release checkpoint folder stores FP8 Engram tables (which can stay in host memory)."""
    folder = Path(folder)
    if converted.is_converted(folder):
        return bool(converted.converted_meta(folder)["engram_fp8"])
    return _has_fp8_engram_table(n.split(".") for n in open_checkpoint(folder))


def _forward_leaves(graphdef, treedef, leaves, ids, hashes, masks=None, *, fake_quant: bool):
    module = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    return forward(module, ids, hashes, fake_quant=fake_quant, **(masks or {}))


def _published_leaves(graphdef, treedef, leaves, ids, hashes, *, fake_quant: bool):
    module = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    return published_rows(module, ids, hashes, fake_quant=fake_quant)


class Model:
    """A loaded model: `config`, `params` ({path: array}), `logits(input_ids)`; `kernels`, the fused ops' kernels
    its forward runs (`with_kernels` gives the same model with others)."""

    def __init__(self, config: ModelConfig, params: dict[tuple, jax.Array], *, dtype=jnp.float32,
                 token_map: np.ndarray | None = None, engram_tables: HostEngramTables | None = None,
                 kernels: KernelConfig = KernelConfig()):
        """`engram_tables`: the Engram tables in host memory (then `params` holds none of them). `kernels`: the
        implementation of the fused ops (`pallas_kernels`) and the XLA path's MoE small-step forms."""
        self.config, self.dtype, self.kernels = config, jnp.dtype(dtype), kernels
        self.engram_tables = engram_tables
        self.formats = weight_formats.of_params(config, params)
        if engram_tables is not None:
            self.formats.update({("layers", lid, "engram", "embed"): ("host",) for lid in config.engram_layer_ids})
        graphdef, abstract = abstract_params(config, dtype, _has_fp8_engram_table(params), self.formats)
        missing = set(abstract) - set(params)
        if missing:
            raise CheckpointError(f"no value for parameter {'.'.join(map(str, sorted(missing, key=str)[0]))}")
        for path, spec in abstract.items():
            if tuple(params[path].shape) != tuple(spec.shape) or params[path].dtype != spec.dtype:
                raise CheckpointError(f"parameter {'.'.join(map(str, path))}: {params[path].dtype}"
                                      f"{list(params[path].shape)}, expected {spec.dtype}{list(spec.shape)}")
        self.params = {p: jnp.asarray(params[p]) for p in abstract}
        state = nnx.from_flat_state([(p, nnx.Param(v)) for p, v in self.params.items()])
        self.module = nnx.merge(graphdef, state)  # its modules hold the default KernelConfig()
        if kernels != KernelConfig():
            self.module = with_kernels(self.module, kernels)
        self._leaves, self._treedef = jax.tree.flatten(nnx.split(self.module)[1])
        self.refresh()
        self.engram = EngramLayout.from_config(config) if config.engram_layer_ids else None
        if self.engram is not None:
            if token_map is None:
                if config.vocab_size > config.engram_compressed_vocab_size:
                    raise CheckpointError(
                        "Engram needs the checkpoint's tokenizer.json to build the compressed token map "
                        f"(vocab_size {config.vocab_size} > engram_compressed_vocab_size "
                        f"{config.engram_compressed_vocab_size})")
                token_map = np.arange(config.vocab_size)
            self.token_map = np.asarray(token_map, np.int64)
        else:
            self.token_map = None

    def refresh(self) -> None:
        """Recompile the forward from the module's current graph: after changing a static field or a hook of
        its modules (e.g. a MoE's `routed_compute`), which are part of the graph definition."""
        graphdef = nnx.split(self.module)[0]
        self._fn = jax.jit(functools.partial(_forward_leaves, graphdef, self._treedef), static_argnames=("fake_quant",))
        self._published = jax.jit(functools.partial(_published_leaves, graphdef, self._treedef),
                                  static_argnames=("fake_quant",))

    def with_kernels(self, kernels: KernelConfig) -> Model:
        """This model running its fused ops (`logits`, `masked_logits`, `published_rows`, a runner's steps) with
        `kernels`, e.g. `KernelConfig(impl="reference")`: a new Model over the same parameter arrays (nothing is
        copied); this one is left as it is."""
        new = copy.copy(self)
        new.kernels, new.module = kernels, with_kernels(self.module, kernels)
        new._leaves, new._treedef = jax.tree.flatten(nnx.split(new.module)[1])
        new.refresh()
        return new

    def compiled_text(self, n_tokens: int, *, fake_quant: bool = False) -> str:
        """The optimised HLO of the exact forward over `n_tokens` ids (e.g. to check which sorts and TopKs
        XLA emits)."""
        h = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), self.engram_input(np.zeros(n_tokens, np.int64)))
        return self._fn.lower(self._leaves, jax.ShapeDtypeStruct((n_tokens,), jnp.int32), h,
                              fake_quant=fake_quant).compile().as_text()

    def save_converted(self, folder: str | Path) -> None:
        """Save the loaded parameters with Orbax; `load(folder)` then restores them without dequantizing (host
        Engram tables are saved with them and restored as parameters: `load(..., engram_cpu_offload=True)`
        moves them back)."""
        params, formats = dict(self.params), dict(self.formats)
        if self.engram_tables is not None:
            for lid, v, sc in zip(self.config.engram_layer_ids, self.engram_tables.values, self.engram_tables.scales):
                params[("layers", lid, "engram", "embed", "weight")] = np.asarray(v).view(ml_dtypes.float8_e4m3fn)
                params[("layers", lid, "engram", "embed", "scale")] = np.asarray(sc)
                formats.pop(("layers", lid, "engram", "embed"))
        converted.save_converted(folder, self.config, params, self.dtype.name, self.token_map,
                                 _has_fp8_engram_table(params), formats)

    def with_engram_on_host(self) -> Model:
        """This model with its FP8 Engram tables moved from the device parameters to host memory
        (`dsv41.engram_host`); itself when they are there already or it has none."""
        if self.engram_tables is not None or not self.config.engram_layer_ids:
            return self
        values, scales = [], []
        for lid in self.config.engram_layer_ids:
            w, s = (self.params.get(("layers", lid, "engram", "embed", leaf)) for leaf in ("weight", "scale"))
            if s is None:
                raise ValueError(f"layer {lid}'s Engram table is {w.dtype}, not FP8: only FP8 tables (the "
                                 "release format) live in host memory")
            values.append(np.asarray(w).view(np.uint8))
            scales.append(np.asarray(s))
        params = {p: v for p, v in self.params.items() if p[2:4] != ("engram", "embed")}
        return Model(self.config, params, dtype=self.dtype, token_map=self.token_map,
                     engram_tables=HostEngramTables(values, scales), kernels=self.kernels)

    @property
    def num_parameters(self) -> int:
        """Model parameters (a packed MXFP4 byte holds two; scale bytes are not parameters)."""
        return sum(weight_formats.logical_size(p, a) for p, a in self.params.items())

    def device_bytes(self) -> int:
        """Bytes the parameters occupy (all devices, all shards)."""
        return sum(a.nbytes for a in self.params.values())

    def engram_hashes(self, ids_T: np.ndarray) -> np.ndarray | None:
        return None if self.engram is None else self.engram.hash_ids(ids_T, self.token_map)

    def engram_input(self, ids_T: np.ndarray):
        """What the forward takes for Engram: None, the hash ids [T, L, C] (tables on the device) or the rows
        gathered from the host tables (`EngramRows`)."""
        h = self.engram_hashes(ids_T)
        if h is None:
            return None
        return jax.tree.map(jnp.asarray, self.engram_tables.gather(h) if self.engram_tables else h)

    def _check_ids(self, input_ids) -> np.ndarray:
        ids = np.asarray(input_ids)
        if ids.ndim not in (1, 2) or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"input_ids must be integer [T] or [B, T], got {ids.dtype}{list(ids.shape)}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise ValueError(f"input_ids must lie in [0, {self.config.vocab_size}), got {ids.min()}..{ids.max()}")
        if ids.shape[-1] == 0:
            raise ValueError("input_ids is empty")
        return ids

    def logits(self, input_ids, *, fake_quant: bool = False) -> np.ndarray:
        """Exact full-sequence logits: [T] ids -> [T, vocab] float32 ([B, T] -> [B, T, vocab])."""
        ids = self._check_ids(input_ids)
        if fake_quant and self.config.family != "v41":
            raise ValueError("fake_quant models the V4.1 reference's activation formats; this is a V4 model")
        if ids.ndim == 2:
            return np.stack([self.logits(row, fake_quant=fake_quant) for row in ids])
        out = self._fn(self._leaves, jnp.asarray(ids, jnp.int32), self.engram_input(ids), fake_quant=fake_quant)
        return np.asarray(out)

    def masked_logits(self, input_ids, *, swa_floor=None, decoder_floor=None, frozen=None,
                      fake_quant: bool = False) -> np.ndarray:
        """Full-sequence logits [T, vocab] with the bounded-replay masks of `model.forward_hidden`."""
        ids = self._check_ids(input_ids)
        masks = {k: v for k, v in (("swa_floor", swa_floor), ("decoder_floor", decoder_floor),
                                   ("frozen", frozen)) if v is not None}
        out = self._fn(self._leaves, jnp.asarray(ids, jnp.int32), self.engram_input(ids),
                       jax.tree.map(jnp.asarray, masks), fake_quant=fake_quant)
        return np.asarray(out)

    def published_rows(self, input_ids, *, fake_quant: bool = False
                       ) -> dict[int, tuple[np.ndarray, np.ndarray | None]]:
        """{KV source: (global rows [N, d], index keys [N, ihd] or None: V4's HCA)} of a cold pass over `input_ids`."""
        ids = self._check_ids(input_ids)
        out = self._published(self._leaves, jnp.asarray(ids, jnp.int32), self.engram_input(ids),
                              fake_quant=fake_quant)
        return {s: (np.asarray(r), None if k is None else np.asarray(k)) for s, (r, k) in out.items()}


def load(path: str | Path, dtype: str | jnp.dtype | None = None, *, weights: str = "release",
         engram_cpu_offload: bool = False, shardings=None, progress: bool = False,
         kernels: KernelConfig = KernelConfig()) -> Model:
    """A release checkpoint folder (config.json + safetensors) -> Model, or a folder written by
    `Model.save_converted` (in the dtype and formats it was saved with).

    dtype: the compute dtype, "float32" (the default: exactness work) | "bfloat16" | "auto" (`auto_dtype`).
    weights: "release" keeps FP8 linears and MXFP4 experts in those formats on the device, decoded where they
    are used (`dsv41.weight_formats`); "dequantize" decodes them to the compute dtype at load.
    engram_cpu_offload: the FP8 Engram tables stay in host memory, mapped from the files (`dsv41.engram_host`);
    each forward gathers the rows it needs.
    shardings: `(parameter path, shape) -> Sharding` (e.g. `sharding.rules.param_sharding_fn(mesh)`): each
    device receives only its shard of each tensor, streamed from the mapped files. progress: a loading bar.
    kernels: the fused ops' kernels (`Model.kernels`)."""
    folder = Path(path)
    config = load_config(folder)
    if weights not in ("release", "dequantize"):
        raise ValueError(f"weights must be 'release' or 'dequantize', got {weights!r}")
    if converted.is_converted(folder):
        meta = converted.converted_meta(folder)
        saved = meta["dtype"]
        if dtype not in (None, "auto") and jnp.dtype(DTYPES.get(dtype, dtype)) != jnp.dtype(DTYPES[saved]):
            raise CheckpointError(f"{folder} was converted to {saved}; load it with dtype={saved!r}")
        formats = weight_formats.from_json(meta.get("formats", []))
        _, abstract = abstract_params(config, DTYPES[saved], meta["engram_fp8"], formats)
        params, token_map = converted.load_converted(folder, abstract)
        model = Model(config, params, dtype=DTYPES[saved], token_map=token_map, kernels=kernels)
        return model.with_engram_on_host() if engram_cpu_offload else model
    entries = open_checkpoint(folder)
    dt = resolve_dtype(dtype or "float32", entries)
    engram_fp8 = _has_fp8_engram_table(n.split(".") for n in entries)
    formats = {}
    if weights == "release":
        _, dense = abstract_params(config, dt, engram_fp8)
        formats = weight_formats.from_checkpoint(config, entries, checkpoint.release_names(config, list(dense)))
    tables, elsewhere = None, frozenset()
    if engram_cpu_offload and config.engram_layer_ids:
        tables = HostEngramTables.from_checkpoint(entries, config.engram_layer_ids)
        formats.update({("layers", lid, "engram", "embed"): ("host",) for lid in config.engram_layer_ids})
        elsewhere = frozenset(f"layers.{lid}.engram.embed.{leaf}" for lid in config.engram_layer_ids
                              for leaf in ("weight", "scale"))
    _, abstract = abstract_params(config, dt, engram_fp8, formats)
    params, _ = checkpoint.load_params(folder, config, abstract, elsewhere, shardings=shardings, progress=progress)
    token_map = None
    if config.engram_layer_ids and (folder / "tokenizer.json").exists():
        token_map, size = build_compressed_token_map(folder / "tokenizer.json", config.vocab_size,
                                                     config.engram_pad_token_id)
        if size != config.engram_compressed_vocab_size:
            raise CheckpointError(f"tokenizer.json gives {size} compressed Engram ids but "
                                  f"engram_compressed_vocab_size is {config.engram_compressed_vocab_size}")
    return Model(config, params, dtype=dt, token_map=token_map, engram_tables=tables, kernels=kernels)


def resolve_dtype(dtype: str | jnp.dtype, entries: dict | None = None) -> jnp.dtype:
    """A compute dtype name ("float32" | "bfloat16" | "auto") or dtype -> the dtype; "auto" = `auto_dtype`."""
    if not isinstance(dtype, str):
        return jnp.dtype(dtype)
    if dtype == "auto":
        return auto_dtype(entries or {})
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES) + ['auto']}, got {dtype!r}")
    return jnp.dtype(DTYPES[dtype])


def auto_dtype(entries: dict, *, release: bool | None = None) -> jnp.dtype:
    """The compute dtype `--dtype auto` picks for a checkpoint's tensors (`{name: TensorEntry}`).

    Rule: the checkpoint's dtype - bfloat16 for a release checkpoint (FP8 / MXFP4 / BF16 tensors; `release`
    says it without entries, e.g. for a preset), float32 for one stored in float32 - except that on a CPU backend
    bfloat16 is used only where this CPU runs XLA's bfloat16 matmuls clearly faster than float32 ones
    (`cpu_prefers_bfloat16`). XLA:CPU hands bf16 dots of 2+ rows to YNNPACK, which uses AMX or AVX512-BF16 where
    the CPU has them (there bf16 runs several times faster than f32); without them bf16 is converted and slower than
    f32 (docs/design/measurements.md)."""
    stored = {e.dtype for e in entries.values()}
    wants_bf16 = bool(stored & {"BF16", "F16", "F8_E4M3", "I8"}) if release is None else release
    return jnp.dtype(jnp.bfloat16 if wants_bf16 and (not _on_cpu() or cpu_prefers_bfloat16()) else jnp.float32)


def _on_cpu() -> bool:
    return jax.default_backend() == "cpu"


BF16_MARGIN = 1.25  # bfloat16 must beat float32 by this factor: a near tie stays float32


@functools.cache
def cpu_prefers_bfloat16() -> bool:
    """Whether XLA:CPU runs a [256, 2048] x [2048, 2048] matmul at least BF16_MARGIN x faster in bfloat16 than in
    float32 on this machine (best of 3 each, once per process: a fraction of a second). On an AMX machine bf16 wins
    by far, and the decode-sized dots of 2+ rows gain too, while a 1-row bf16 dot misses YNNPACK and runs slower
    than either, so the runtime pads a batch of one (`serving.runtime.compiler._smallest_bucket`; the figures:
    docs/design/measurements.md)."""
    def best_seconds(dtype) -> float:
        x, w = jnp.ones((256, 2048), dtype), jnp.ones((2048, 2048), dtype)
        dot = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32))
        dot(x, w).block_until_ready()
        times = []
        for _ in range(3):
            t = time.perf_counter()
            dot(x, w).block_until_ready()
            times.append(time.perf_counter() - t)
        return min(times)

    return best_seconds(jnp.float32) >= BF16_MARGIN * best_seconds(jnp.bfloat16)


def random_model(config: ModelConfig | str, seed: int = 0, dtype: str | jnp.dtype = "float32",
                 engram_fp8: bool = False, *, weights: str | None = None, engram_cpu_offload: bool = False,
                 kernels: KernelConfig = KernelConfig()) -> Model:
    """A model with deterministic random weights (host-drawn), e.g. `random_model("tiny")`.

    weights: "float" (every weight in `dtype`, the test presets) or "release" (FP8 linears, MXFP4 experts and FP8
    Engram tables drawn as bytes, `init.random_release_params`: how a full-width preset fits a GPU); default:
    "release" for configs that carry a quantization_config (the full-size presets), else "float".
    engram_cpu_offload (release weights): the random Engram tables live in host memory. kernels: the fused ops'
    kernels (`Model.kernels`)."""
    c = load_config(config) if isinstance(config, str) else config
    dt = DTYPES[dtype] if isinstance(dtype, str) else dtype
    weights = weights or ("release" if c.quantization else "float")
    if weights == "float":
        _, abstract = abstract_params(c, dt, engram_fp8)
        return Model(c, random_params(c, abstract, seed), dtype=dt, kernels=kernels)
    if weights != "release":
        raise ValueError(f"weights must be 'float' or 'release', got {weights!r}")
    _, dense = abstract_params(c, dt, True)
    _, abstract = abstract_params(c, dt, True, checkpoint.release_formats(c, list(dense)))
    tables = frozenset(p for p in abstract if p[2:4] == ("engram", "embed")) if engram_cpu_offload else frozenset()
    params = random_release_params(c, abstract, seed, on_host=tables)
    host = None
    if tables:
        host = HostEngramTables([params.pop(("layers", lid, "engram", "embed", "weight")).view(np.uint8)
                                 for lid in c.engram_layer_ids],
                                [params.pop(("layers", lid, "engram", "embed", "scale")) for lid in c.engram_layer_ids])
    token_map = np.arange(c.vocab_size) % max(c.engram_compressed_vocab_size, 1) if c.engram_layer_ids else None
    return Model(c, params, dtype=dt, token_map=token_map, engram_tables=host, kernels=kernels)
