"""dsv41: the DeepSeek-V4.1-Flash text model (and V4-Flash compatibility) in JAX / Flax NNX.

    import dsv41
    model = dsv41.load("path/to/checkpoint", dtype="float32")   # or dsv41.random_model("tiny")
    logits = model.logits([0, 17, 5])                            # [T, vocab] float32
"""

from dsv41.api import Model, abstract_params, auto_dtype, load, random_model
from dsv41.config import PRESETS, ConfigError, LayerRole, ModelConfig, load_config
from dsv41.safetensors_io import CheckpointError

__all__ = ["CheckpointError", "ConfigError", "LayerRole", "Model", "ModelConfig", "PRESETS", "abstract_params",
           "auto_dtype", "load", "load_config", "random_model"]
