"""Training initialisation and the split of the parameters into what each optimiser touches.

`init_train_params` draws every tensor on the host from one seed (NumPy, sorted path order, like
`dsv41.init`), with a training-style scale instead of the test noise there:

* matrices N(0, 0.02) (the release's initializer_range), output projections (attention wo_b, expert w2)
  N(0, 0.02 / sqrt(2 * layers)) so the residual streams start near the embedding;
* norm weights and Engram's q/k weights 1; attention sinks, router biases, the confidence head 0;
* mHC: `fn` N(0, 1/sqrt(nD)) with `scale` 0.1 (token-dependent mixes start small), `base` 0 for pre and
  post (pre 0.5, post 1) and +4 on the diagonal of the stream mix (Sinkhorn of a near-identity), so each
  stream keeps its own residual at first and the random `fn` breaks the symmetry between streams.

Groups (`param_group`): "bias" = every MoE router's `gate.bias` (aux-loss-free balancing moves it by a
rule, never by a gradient), "dspark" = the drafter's own tensors, "backbone" = everything else.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from dsv41.config import ModelConfig

_NORMS = {"attn_norm", "ffn_norm", "q_norm", "kv_norm", "norm", "k_norm", "main_norm"}
_RESIDUAL_OUT = {"wo_b", "w2"}
INIT_STD = 0.02


def _draw(path: tuple, shape: tuple[int, ...], rng: np.random.Generator, c: ModelConfig) -> np.ndarray:
    names = [p for p in path if isinstance(p, str)]
    leaf, parent = names[-1], names[-2] if len(names) > 1 else ""
    if (leaf == "weight" and parent in _NORMS) or leaf in ("q_weight", "k_weight"):
        return np.ones(shape, np.float32)
    if leaf in ("attn_sink", "bias") or parent == "confidence":
        return np.zeros(shape, np.float32)
    if leaf == "scale" and parent in ("hc_attn", "hc_ffn"):
        return np.full(shape, 0.1, np.float32)
    if leaf == "base" and parent in ("hc_attn", "hc_ffn"):
        n = c.hc_mult
        base = np.zeros(shape, np.float32)
        base[2 * n:] = 4.0 * np.eye(n, dtype=np.float32).reshape(-1)
        return base
    n = rng.standard_normal(shape, dtype=np.float32)
    if leaf == "fn":
        return n / np.sqrt(shape[-1])
    std = INIT_STD
    if leaf in _RESIDUAL_OUT or parent in _RESIDUAL_OUT:
        std /= math.sqrt(2 * c.num_hidden_layers)
    return n * std


def init_train_params(c: ModelConfig, abstract: dict[tuple, jax.ShapeDtypeStruct], seed: int
                      ) -> dict[tuple, np.ndarray]:
    """float32 NumPy arrays for every path of `abstract` (an unquantized model's parameters)."""
    rng = np.random.default_rng(seed)
    out = {}
    for path in sorted(abstract, key=lambda p: tuple(str(x) for x in p)):
        spec = abstract[path]
        if spec.dtype != np.float32:
            raise ValueError(f"parameter {'.'.join(map(str, path))} is {spec.dtype}: train in float32")
        out[path] = _draw(path, tuple(spec.shape), rng, c)
    return out


def param_group(path: tuple) -> str:
    """"bias" | "dspark" | "backbone" (module docstring)."""
    if path[-2:] == ("gate", "bias"):
        return "bias"
    return "dspark" if path[0] == "dspark" else "backbone"


def decays(path: tuple) -> bool:
    """Weight decay on matrices only: not on norms, sinks, mHC bases/scales or 1-d tensors."""
    names = [p for p in path if isinstance(p, str)]
    leaf, parent = names[-1], names[-2] if len(names) > 1 else ""
    if parent in _NORMS or leaf in ("attn_sink", "base", "scale", "q_weight", "k_weight", "bias"):
        return False
    return True
