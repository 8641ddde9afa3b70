"""What the runtime is built for: capacities (which fix the compiled shapes), the KV-cache format, the
replay mode and the fused-op implementation. `max_num_seqs`, `max_num_batched_tokens` and the KV memory
are per data-parallel rank (as vLLM's DP). The scheduler reads the capacities from here too.

Each field is also a server flag (`serving.engine.args`: the name, `help` and `choices` make the flag)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pallas_kernels import IMPLS
from pallas_kernels.moe_xla import SMALL_STEP_FORMS
from serving.runtime.kv_cache import FORMATS
from serving.runtime.speculative import SpeculativeConfig

# `moe_small_steps`: "tune" (serving.runtime.moe_tuning), "rule" (batched, weights right) or one form for all
MOE_SMALL_STEPS = ("rule", "tune", *SMALL_STEP_FORMS)


@dataclass(frozen=True)
class RuntimeConfig:
    max_num_seqs: int = field(default=32, metadata={"help": "running requests (KV slots) per data-parallel rank"})
    # the best worst case over the peers and agentic workloads, cold and warm, of the budgets measured
    # (`serving.bench.defaults`, docs/benchmarks/defaults.md)
    max_num_batched_tokens: int = field(default=512, metadata={"help": "tokens per step per data-parallel rank"})
    max_model_len: int = field(default=4096, metadata={"help": "longest sequence, prompt + output, in tokens"})
    block_size: int | None = field(default=None, metadata={
        "help": "tokens per KV-cache block, the prefix-cache unit (default: the smallest size >= 64 holding whole "
                "compressed rows of every layer: 64 for V4.1, 128 for V4's ratio-128 layers)"})
    kv_cache_dtype: str = field(default="auto", metadata={
        "choices": FORMATS, "help": "auto: the compute dtype (exact); release: FP8 SWA / NVFP4 global / MXFP4 "
                                    "indexer records"})
    kv_cache_memory: int | None = field(default=None, metadata={
        "help": "bytes for the KV cache per data-parallel rank (default: max-num-seqs requests of max-model-len)"})
    swa_bounded_replay: bool = field(default=True, metadata={
        "help": "after a prefix hit, replay only the last window (vLLM's mode; not bit-identical to a cold run); "
                "off: recompute the exact halo"})
    tile: int = field(default=8, metadata={"help": "query rows per tile of the attention and indexer XLA paths (one "
                                                   "request's consecutive rows share its cache reads); steps of at "
                                                   "most max_num_seqs rows tile each row alone"})
    fake_quant: bool = field(default=False, metadata={
        "help": "apply the reference's FP8 / FP4 activation fake-quant (as the release inference code)"})
    max_top_k: int = field(default=256, metadata={
        "help": "sampler candidates per row: top-k / top-p / min-p act on this many largest logits"})
    seed: int = field(default=0, metadata={
        "help": "seed of the engine's sampling (requests without a seed draw one from it) and of a preset's "
                "random weights"})
    token_buckets: tuple[int, ...] | None = field(default=None, metadata={
        "help": "step sizes to compile, comma-separated (default: powers of two, then window multiples "
                "1-2-3-4-6-8... up to max-num-batched-tokens); a bfloat16 model on a CPU steps at least 2 rows "
                "(a 1-row bf16 dot is slow on XLA:CPU)"})
    speculative_config: str | None = field(default=None, metadata={
        "help": "speculative decoding, vLLM's JSON: '{\"method\": \"dspark\", \"num_speculative_tokens\": 5, "
                "\"rejection_sample_method\": \"standard\"}' (or synthetic with synthetic_acceptance_length); "
                "num_speculative_tokens defaults to the checkpoint's DSpark block"})
    kernel_impl: str = field(default="auto", metadata={
        "choices": IMPLS, "help": "fused-op implementation (pallas_kernels): auto = pallas on a GPU, xla "
                                  "elsewhere; xla or reference is the fallback if a Pallas kernel misbehaves"})
    kernel_tiles: str = field(default="stored", metadata={
        "help": "the Pallas GEMMs' tuned implementation and tiles per shape where auto runs Pallas (a GPU): stored = "
                "the table `python -m serving.bench.autotune` wrote for this device kind (pallas_kernels/tuned/; "
                "none stored: the kernels' own rules); none = the kernels' own rules; or a table's path"})
    moe_small_steps: str = field(default="tune", metadata={
        "choices": MOE_SMALL_STEPS, "help": "routed experts of steps with few rows per expert (decode) on the XLA "
                                            "path (CPU), float experts: tune = the fastest form on this machine among "
                                            "those giving rule's bits, timed once per step shape and machine just "
                                            "before the first bucket running it compiles (kept beside the executable "
                                            "cache); rule = batched, weights on the right; or one form"})

    def __post_init__(self):
        if isinstance(self.speculative_config, (dict, SpeculativeConfig)):  # LLM(speculative_config={...})
            object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config).to_json())
        SpeculativeConfig.parse(self.speculative_config)  # a bad one is refused here, naming the field
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "tile", "max_top_k"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        for name, allowed in (("kv_cache_dtype", FORMATS), ("kernel_impl", IMPLS),
                              ("moe_small_steps", MOE_SMALL_STEPS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.kernel_tiles not in ("stored", "none") and not Path(self.kernel_tiles).is_file():
            raise ValueError(f"kernel_tiles must be stored, none or a tile table's path; no file {self.kernel_tiles!r}")
        if self.token_buckets is not None and (not self.token_buckets or min(self.token_buckets) < 1
                                               or max(self.token_buckets) < self.max_num_batched_tokens):
            raise ValueError(f"token_buckets {self.token_buckets} must be positive and reach "
                             f"max_num_batched_tokens ({self.max_num_batched_tokens})")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (every running request needs a row)")
