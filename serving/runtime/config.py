"""What the runtime is built for: capacities (which fix the compiled shapes), the KV-cache format, the
replay mode and the fused-op implementation. `max_num_seqs`, `max_num_batched_tokens` and the KV memory
are per data-parallel rank (as vLLM's DP)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RuntimeConfig:
    max_num_seqs: int = 8  # per data-parallel rank
    max_num_batched_tokens: int = 512  # per data-parallel rank
    max_model_len: int = 4096
    block_size: int = 64
    kv_cache_dtype: str = "auto"  # "auto": compute dtype (exact); "release": FP8 / NVFP4 / MXFP4 records
    kv_cache_memory: int | None = None  # bytes per rank; default: max_num_seqs requests of max_model_len
    swa_bounded_replay: bool = True
    tile: int = 8
    fake_quant: bool = False
    max_top_k: int = 256  # sampler candidate set
    seed: int = 0
    token_buckets: tuple[int, ...] | None = None  # default: `token_ladder` up to max_num_batched_tokens
    kernel_impl: str = "auto"  # fused-op implementation (pallas_kernels): auto = pallas on GPU, xla on CPU

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "tile", "max_top_k"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.token_buckets is not None and (not self.token_buckets or min(self.token_buckets) < 1
                                               or max(self.token_buckets) < self.max_num_batched_tokens):
            raise ValueError(f"token_buckets {self.token_buckets} must be positive and reach "
                             f"max_num_batched_tokens ({self.max_num_batched_tokens})")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (every running request needs a row)")
