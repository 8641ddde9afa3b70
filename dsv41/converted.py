"""A converted checkpoint: the loaded parameters as the device holds them (the compute dtype, and the release
formats `dsv41.weight_formats` kept: FP8 linears, MXFP4 experts, the FP8 Engram table) saved with Orbax, so
restarting skips parsing the release files.

Layout: `config.json` (release style), `dsv41_converted.json` (compute dtype, weight formats, format version)
and an Orbax `params/` tree keyed by the dotted parameter path.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

from dsv41 import weight_formats
from dsv41.config import ModelConfig

MARKER = "dsv41_converted.json"
_TOKEN_MAP = "engram_token_map"


def _key(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def save_converted(folder: str | Path, config: ModelConfig, params: dict[tuple, jax.Array], dtype: str,
                   token_map: np.ndarray | None, engram_fp8: bool, formats: dict | None = None) -> None:
    folder = Path(folder).absolute()
    folder.mkdir(parents=True, exist_ok=True)
    tree = {_key(p): v for p, v in params.items()}
    if token_map is not None:
        tree[_TOKEN_MAP] = np.asarray(token_map, np.int32)
    # here: a slow import (docs/design/measurements.md), which a server start that reads no such folder skips
    import orbax.checkpoint as ocp

    ckpt = ocp.StandardCheckpointer()
    ckpt.save(folder / "params", tree, force=True)
    ckpt.wait_until_finished()
    (folder / "config.json").write_text(json.dumps(config.to_release_dict(), indent=1))
    (folder / MARKER).write_text(json.dumps({"format": 1, "dtype": dtype, "engram_fp8": engram_fp8,
                                             "token_map": token_map is not None,
                                             "formats": weight_formats.to_json(formats or {})}))


def is_converted(folder: str | Path) -> bool:
    return (Path(folder) / MARKER).exists()


def load_converted(folder: str | Path, abstract: dict[tuple, jax.ShapeDtypeStruct]
                   ) -> tuple[dict[tuple, jax.Array], np.ndarray | None]:
    """Restore parameters for `abstract` ({path: ShapeDtypeStruct}) and the Engram token map, if saved."""
    folder = Path(folder).absolute()
    meta = converted_meta(folder)
    target = {_key(p): v for p, v in abstract.items()}
    if meta.get("token_map"):
        n = json.loads((folder / "config.json").read_text())
        vocab = (n.get("text_config") or n)["vocab_size"]
        target[_TOKEN_MAP] = jax.ShapeDtypeStruct((vocab,), np.int32)
    import orbax.checkpoint as ocp

    tree = ocp.StandardCheckpointer().restore(folder / "params", target)
    token_map = np.asarray(tree.pop(_TOKEN_MAP)) if _TOKEN_MAP in tree else None
    by_key = {_key(p): p for p in abstract}
    return {by_key[k]: v for k, v in tree.items()}, token_map


def converted_meta(folder: str | Path) -> dict:
    return json.loads((Path(folder) / MARKER).read_text())
