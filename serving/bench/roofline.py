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

# The probes: a [M, K] x [K, N] dot and a sum over n bytes, large enough to run at the device's rate, short enough
# to take one before every timed run (~0.1-0.2 s on 2 cores; on a GPU ~1.5 ms and ~1 ms, far past a dispatch).
M, K, N = 1024, 4096, 4096
GPU_MKN, GPU_STREAM_BYTES = (8192, 8192, 8192), 1 << 32
_EXPERT_LEAVES = {"w1", "w2", "w3", "w1_scale", "w2_scale", "w3_scale"}


class MatmulProbe:
    """`probe()` -> this device's matmul rate in FLOP/s now: one timed [M, K] x [K, N] dot in `dtype` (the model's
    compute dtype; float32 at full precision, no TF32), compiled and run once when built."""

    def __init__(self, dtype: str = "float32"):
        import jax
        import jax.numpy as jnp

        self.mkn = GPU_MKN if jax.default_backend() == "gpu" else (M, K, N)
        m, k, n = self.mkn
        # random operands: an H200 multiplies zeros ~13% faster than real data
        self._a = jax.random.normal(jax.random.key(0), (m, k), jnp.float32).astype(dtype)
        self._b = jax.random.normal(jax.random.key(1), (k, n), jnp.float32).astype(dtype)
        precision = jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None
        self._dot = jax.jit(lambda a, b: jnp.dot(a, b, precision=precision))
        self._dot(self._a, self._b).block_until_ready()

    def __call__(self) -> float:
        t = time.perf_counter()
        self._dot(self._a, self._b).block_until_ready()
        m, k, n = self.mkn
        return 2.0 * m * k * n / (time.perf_counter() - t)


def matmul_rate(reps: int = 10, dtype: str = "float32") -> float:
    """The median of `reps` matmul probes in `dtype`, FLOP/s."""
    probe = MatmulProbe(dtype)
    return statistics.median(probe() for _ in range(reps))


class StreamProbe:
    """`probe()` -> this device's streaming rate now, bytes read per second: one timed jitted sum over an
    `n_bytes` float32 array (default 256 MiB, 4 GiB on a GPU; compiled and run once when built)."""

    def __init__(self, n_bytes: int | None = None):
        import jax
        import jax.numpy as jnp

        n_bytes = n_bytes or (GPU_STREAM_BYTES if jax.default_backend() == "gpu" else 1 << 28)
        self.n_bytes = n_bytes
        self._x = jnp.ones((n_bytes // 4,), jnp.float32)
        self._sum = jax.jit(jnp.sum)
        self._sum(self._x).block_until_ready()

    def __call__(self) -> float:
        t = time.perf_counter()
        self._sum(self._x).block_until_ready()
        return self.n_bytes / (time.perf_counter() - t)


class RowsDotProbe:
    """`probe()` -> the rate, bytes of weights per second, at which this device's matmul reads a layer's weights in
    a product of `rows` rows (a decode step's token bucket): one timed jitted set of [rows, K] x [N, K] dots in
    `dtype` (the projections' [out, in] layout) over several weight matrices, together past the caches (64 MiB of
    [4096, 512]; 1 GiB of [8192, 4096] on a GPU).

    The streaming floor is what a step would take reading its weights at `StreamProbe`'s rate; this one is what
    its products alone take at the rate the backend's own matmul reaches for that many rows. On XLA:CPU the two
    differ by ~2x: a 2-row bf16 product read its weights at 14.8-15.5 GB/s on the 2-core EPYC whose sum streamed
    24-33 GB/s in the same runs (its GEMM repacks the weight operand on every call)."""

    def __init__(self, rows: int, dtype: str = "float32"):
        import jax
        import jax.numpy as jnp

        n, k = (8192, 4096) if jax.default_backend() == "gpu" else (4096, 512)
        self.rows = rows
        self._x = jax.random.normal(jax.random.key(0), (rows, k), jnp.float32).astype(dtype)
        self._w = [jax.random.normal(jax.random.key(1 + i), (n, k), jnp.float32).astype(dtype) for i in range(16)]
        self.n_bytes = sum(w.nbytes for w in self._w)
        precision = jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None
        self._dots = jax.jit(lambda x, ws: [jnp.einsum("ti,oi->to", x, w, precision=precision,
                                                       preferred_element_type=jnp.float32) for w in ws])
        jax.block_until_ready(self._dots(self._x, self._w))

    def __call__(self) -> float:
        import jax

        t = time.perf_counter()
        jax.block_until_ready(self._dots(self._x, self._w))
        return self.n_bytes / (time.perf_counter() - t)


def weight_read_rate(n_bytes: int | None = None, reps: int = 10) -> float:
    """The median of `reps` streaming probes over `n_bytes`, bytes per second."""
    probe = StreamProbe(n_bytes)
    return statistics.median(probe() for _ in range(reps))


def is_engram_table(path: tuple) -> bool:
    """An Engram layer's hashed table (`layers.N.engram.embed.{weight,scale}`): gathered a few rows per token, never
    read whole; host-resident in serving (`layout_memory` leaves it out of the device's bytes)."""
    return len(path) >= 4 and path[0] == "layers" and path[2:4] == ("engram", "embed")


def prefill_flops(config, n: int, decoder_rows: int | None = None) -> float:
    """FLOPs of one n-token prefill from position 0: 2 x the parameters a token activates (attention, shared and
    k routed experts; no embedding, and no Engram table: its rows are gathered, not multiplied) per token, plus
    each layer's attention (q.k and p.v over the window and the global rows a query reads: CSA min(k, visible),
    HCA all visible) and the CSA indexer's scores. `decoder_rows`: the layers after the CED cut run only the last
    that many rows (decoder replay: the window), whose window starts at the first of them, the layers up to it all
    n; None: every layer runs all n."""
    import dsv41

    _, shapes = dsv41.abstract_params(config)
    E, k = config.n_routed_experts, config.num_experts_per_tok
    active = [0.0] * config.num_hidden_layers  # per layer
    for path, a in shapes.items():
        if path[0] != "layers" or is_engram_table(path):
            continue
        size = float(a.size)
        active[path[1]] += size * k / E if "experts" in path else size  # routed; shared ones are "shared_experts"
    H, d, W = config.num_attention_heads, config.head_dim, config.sliding_window
    cut = config.cut_layer
    flops = 0.0
    for layer, role in enumerate(config.roles):
        rows_run = n if decoder_rows is None or cut is None or layer <= cut else min(n, decoder_rows)
        flops += 2.0 * active[layer] * rows_run
        floor = n - rows_run  # trimmed rows' window starts at the first kept row (decoder_replay.kept_rows)
        for t in range(floor, n):
            rows = min(t + 1 - floor, W)
            if role.compress_ratio:
                visible = (t + 1) // role.compress_ratio
                rows += visible if role.attn_kind == "hca" else min(config.index_topk, visible)
                if role.is_index_source:
                    flops += 2.0 * config.index_n_heads * config.index_head_dim * visible
            flops += 4.0 * H * d * rows
    return flops


def decode_weight_bytes(model, batch: int) -> float:
    """Parameter bytes a decode step of `batch` tokens reads: every backbone weight once, the embedding rows of
    the batch, each Engram layer's hash-column rows of the batch (its table's rows and their scales; at most the
    table), and of each layer's routed experts the expected share touched by uniform routing
    (E * (1 - (1 - k/E)^batch) of E); the DSpark drafter is not run by a plain decode step."""
    c = model.config
    total = 0.0
    for path, a in model.params.items():
        if path[0] == "dspark":
            continue
        if path == ("embed", "weight"):
            total += batch * a.nbytes / a.shape[0]
        elif is_engram_table(path):
            total += min(a.nbytes, batch * c.engram_hash_cols * a.nbytes / a.shape[0])
        elif str(path[-1]) in _EXPERT_LEAVES:
            E, k = a.shape[0], c.num_experts_per_tok
            total += a.nbytes * (1 - (1 - k / E) ** batch)
        else:
            total += a.nbytes
    return total
