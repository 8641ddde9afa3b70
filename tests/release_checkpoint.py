"""A model written as a release checkpoint folder (config.json + safetensors), as the tests load them."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import dsv41
from dsv41.checkpoint import save_checkpoint


def write_release(folder: Path, model: dsv41.Model | str, *, seed: int = 0, quantize: bool = True) -> Path:
    """`model` (or a preset's random model drawn from `seed`) saved in `folder`: FP8 / MXFP4 release formats when
    `quantize`, else each parameter in its own dtype. Returns `folder`."""
    m = dsv41.random_model(model, seed=seed) if isinstance(model, str) else model
    save_checkpoint(folder, m.config, {p: np.asarray(v) for p, v in m.params.items()}, quantize=quantize)
    return folder
