"""What `--model` names, loaded: a checkpoint folder (release safetensors or a converted Orbax copy), a preset
with deterministic random weights and the byte-level tokenizer carrying the V4.1 special tokens, or nothing -
the built-in default, nano-austen (`dsv41.nano`): a nano V4.1 trained on Jane Austen, committed in the release
layout and loaded like the real checkpoint."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import jax

import dsv41
from dsv41.api import fp8_engram_tables
from dsv41.nano import NANO_DIR
from serving.text.template_kwargs import ChatTemplateKwargs, read_checkpoint_defaults
from serving.text.tokenizer import Tokenizer, byte_level_tokenizer

DEFAULT_NAME = "dsv41-nano-austen"
DTYPES = ("auto", "float32", "bfloat16")


@dataclass(frozen=True)
class ModelArgs:
    """What to serve (each field is also a server flag, see `serving.engine.args`). The seed of a preset's random
    weights is the runtime's `seed`."""

    model: str | None = field(default=None, metadata={
        "help": "checkpoint folder (release safetensors or converted), or a preset name (random weights); default: "
                "the built-in nano-austen, a nano V4.1 trained on Jane Austen"})
    served_model_name: str | None = field(default=None, metadata={
        "help": "model id clients send (default: the folder or preset name)"})
    dtype: str = field(default="auto", metadata={"choices": DTYPES, "help": (
        "compute dtype; auto = the checkpoint's (bfloat16 for a release checkpoint and the full-size presets, "
        "float32 for one stored in float32 and the test presets); on a CPU backend bfloat16 only where this CPU "
        "runs XLA's bf16 matmuls faster than float32 ones (AMX / AVX512-BF16; measured at start-up, "
        "dsv41.auto_dtype)")})
    engram_cpu_offload: bool | None = field(default=None, metadata={
        "help": "keep a checkpoint's FP8 Engram tables in host memory, mapped from its files and shared by every "
                "process on the host; each step gathers only its rows (vLLM's engram cpu_offload), and steps go "
                "one at a time (no async scheduling). Default: on for an accelerator (V4.1-Flash's tables are "
                "203 GB), off on a CPU backend, whose device memory is host memory already. Tables that are not "
                "FP8 (unquantized checkpoints, test presets) stay on the device"})

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")


@dataclass
class ModelSource:
    model: dsv41.Model
    tokenizer: Tokenizer | None
    name: str  # the served model name
    description: str  # one line for the banner
    # what the checkpoint folder states about thinking (`tokenizer_config.json`); None: nothing, V4.1's recipe
    chat_template_kwargs: ChatTemplateKwargs | None = None


def load_model(args: ModelArgs, seed: int = 0, parallel=None, progress: bool = False) -> ModelSource:
    """The model, its tokenizer and its served name; `seed` draws a preset's random weights. `parallel`
    (sharding.mesh.ParallelConfig) over several devices: a checkpoint's tensors are placed on that mesh as
    they are read, each device receiving only its shards. `progress`: a loading bar on stderr."""
    shardings = None
    if parallel is not None and parallel.world_size > 1:
        from sharding.mesh import make_mesh
        from sharding.rules import param_sharding_fn

        shardings = param_sharding_fn(make_mesh(parallel))
    src = _load(args.model, args.dtype, seed, engram_offload(args.engram_cpu_offload), shardings, progress)
    src.name = args.served_model_name or src.name
    src.description += f"; {_weights(src.model)}"
    return src


def engram_offload(flag: bool | None) -> bool:
    """`--[no-]engram-cpu-offload`, or where it is not given: host memory for an accelerator's tables; on a CPU
    backend device arrays are host memory, so mapping the tables apart would only cost async scheduling."""
    return flag if flag is not None else jax.default_backend() != "cpu"


def _load_checkpoint(path: Path, dtype: str, engram_cpu_offload: bool, shardings, progress: bool) -> dsv41.Model:
    offload = engram_cpu_offload and fp8_engram_tables(path)
    return dsv41.load(path, dtype=dtype, engram_cpu_offload=offload, shardings=shardings, progress=progress)


def _load(model: str | None, dtype: str, seed: int, engram_cpu_offload: bool, shardings=None,
          progress: bool = False) -> ModelSource:
    if model is None:
        m = _load_checkpoint(NANO_DIR, dtype, engram_cpu_offload, shardings, progress)
        return ModelSource(m, Tokenizer.from_dir(NANO_DIR), DEFAULT_NAME,
                           f"built-in default: nano-austen, a {_params(m)} V4.1 trained on five Jane Austen novels "
                           f"(release formats, {NANO_DIR}); it writes Austen-like prose, not answers - pass --model "
                           "for a checkpoint", read_checkpoint_defaults(NANO_DIR))
    path = Path(model)
    if path.is_dir():
        m = _load_checkpoint(path, dtype, engram_cpu_offload, shardings, progress)
        tok = Tokenizer.from_dir(path) if (path / "tokenizer.json").is_file() else None
        note = "" if tok else " (no tokenizer.json: token-id prompts only)"
        return ModelSource(m, tok, path.name, f"checkpoint {path}{note}", read_checkpoint_defaults(path))
    if model in dsv41.PRESETS:
        release = dsv41.load_config(model).quantization is not None  # the full-size presets: release formats
        if dtype == "auto":
            dtype = dsv41.auto_dtype({}, release=release).name
        m = dsv41.random_model(model, seed=seed, dtype=dtype, engram_cpu_offload=release and engram_cpu_offload)
        return ModelSource(m, byte_level_tokenizer(m.config.vocab_size), f"dsv41-{model}",
                           f"preset '{model}' with random weights (seed {seed}) and a byte-level tokenizer")
    raise ValueError(f"--model {model!r} is neither a checkpoint folder nor a preset "
                     f"({', '.join(sorted(dsv41.PRESETS))})")


def _params(m: dsv41.Model) -> str:
    return f"{m.num_parameters / 1e6:.1f}M-parameter"


def _weights(m: dsv41.Model) -> str:
    kinds = sorted({f[0].upper() for f in m.formats.values() if f[0] != "host"})
    kept = f"{' and '.join(kinds)} weights kept in their release formats, " if kinds else ""
    host = (f", Engram tables in host memory ({m.engram_tables.nbytes / 2**20:.1f} MiB mapped)"
            if m.engram_tables is not None else "")
    return f"compute dtype {m.dtype.name}, {kept}{m.device_bytes() / 2**20:.1f} MiB of parameters on the device{host}"
