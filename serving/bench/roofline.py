"""This machine's roofline and what a step of the model needs from it: the matmul rate, the weight-streaming rate,
a prefill's FLOPs and a decode step's weight bytes. `serving.bench.prefill` (the bare steps) and
`serving.bench.peers` (the served engine) quote our times as fractions of these.

The probes are short on purpose: this machine's speed drifts 10-30% within minutes (shared cores), so a bench
that times one probe right before each of its own runs compares the two under the same conditions
(`MatmulProbe`, `StreamProbe`), instead of one rate measured once against runs taken minutes later.
"""

from __future__ import annotations

import statistics
import time

# The matmul probe: a [M, K] x [K, N] dot, large enough to run at the BLAS rate, short enough (~0.1-0.2 s
# on 2 cores) to take one before every timed run.
M, K, N = 1024, 4096, 4096
_EXPERT_LEAVES = {"w1", "w2", "w3", "w1_scale", "w2_scale", "w3_scale"}


class MatmulProbe:
    """`probe()` -> this device's matmul rate in FLOP/s now: one timed [M, K] x [K, N] dot in `dtype` (the model's
    compute dtype; float32 at full precision, no TF32), compiled and run once when built."""

    def __init__(self, dtype: str = "float32"):
        import jax
        import jax.numpy as jnp

        self._a, self._b = jnp.ones((M, K), dtype), jnp.ones((K, N), dtype)
        precision = jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None
        self._dot = jax.jit(lambda a, b: jnp.dot(a, b, precision=precision))
        self._dot(self._a, self._b).block_until_ready()

    def __call__(self) -> float:
        t = time.perf_counter()
        self._dot(self._a, self._b).block_until_ready()
        return 2.0 * M * K * N / (time.perf_counter() - t)


def matmul_rate(reps: int = 10, dtype: str = "float32") -> float:
    """The median of `reps` matmul probes in `dtype`, FLOP/s."""
    probe = MatmulProbe(dtype)
    return statistics.median(probe() for _ in range(reps))


class StreamProbe:
    """`probe()` -> this device's streaming rate now, bytes read per second: one timed jitted sum over an
    `n_bytes` float32 array (compiled and run once when built)."""

    def __init__(self, n_bytes: int = 1 << 28):
        import jax
        import jax.numpy as jnp

        self.n_bytes = n_bytes
        self._x = jnp.ones((n_bytes // 4,), jnp.float32)
        self._sum = jax.jit(jnp.sum)
        self._sum(self._x).block_until_ready()

    def __call__(self) -> float:
        t = time.perf_counter()
        self._sum(self._x).block_until_ready()
        return self.n_bytes / (time.perf_counter() - t)


def weight_read_rate(n_bytes: int = 1 << 28, reps: int = 10) -> float:
    """The median of `reps` streaming probes over `n_bytes`, bytes per second."""
    probe = StreamProbe(n_bytes)
    return statistics.median(probe() for _ in range(reps))


def prefill_flops(config, n: int) -> float:
    """FLOPs of one n-token prefill from position 0: 2 x the parameters a token activates (attention, shared and
    k routed experts; no embedding) per token, plus each layer's attention (q.k and p.v over the window and the
    global rows a query reads: CSA min(k, visible), HCA all visible) and the CSA indexer's scores."""
    import dsv41

    _, shapes = dsv41.abstract_params(config)
    E, k = config.n_routed_experts, config.num_experts_per_tok
    active = 0.0
    for path, a in shapes.items():
        if path[0] != "layers":
            continue
        size = float(a.size)
        active += size * k / E if "experts" in path else size  # routed experts; shared ones are "shared_experts"
    flops = 2.0 * active * n
    H, d, W = config.num_attention_heads, config.head_dim, config.sliding_window
    for role in config.roles:
        for t in range(n):
            rows = min(t + 1, W)
            if role.compress_ratio:
                visible = (t + 1) // role.compress_ratio
                rows += visible if role.attn_kind == "hca" else min(config.index_topk, visible)
                if role.is_index_source:
                    flops += 2.0 * config.index_n_heads * config.index_head_dim * visible
            flops += 4.0 * H * d * rows
    return flops


def decode_weight_bytes(model, batch: int) -> float:
    """Parameter bytes a decode step of `batch` tokens reads: every backbone weight once, the embedding rows of
    the batch, and of each layer's routed experts the expected share touched by uniform routing
    (E * (1 - (1 - k/E)^batch) of E); the DSpark drafter is not run by a plain decode step."""
    c = model.config
    total = 0.0
    for path, a in model.params.items():
        if path[0] == "dspark":
            continue
        if path == ("embed", "weight"):
            total += batch * a.nbytes / a.shape[0]
        elif str(path[-1]) in _EXPERT_LEAVES:
            E, k = a.shape[0], c.num_experts_per_tok
            total += a.nbytes * (1 - (1 - k / E) ** batch)
        else:
            total += a.nbytes
    return total
