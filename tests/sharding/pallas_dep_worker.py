"""Run in a subprocess with 4 virtual CPU devices: the runtime with the Pallas kernels (interpreted on CPU)
inside the per-rank shard_map of dp2 x tp2 (experts over all 4), one request on rank 1, prefill then decode,
against the model with the reference ops; and the head count each attention kernel call sees (each tp rank
its own heads). Prints one JSON object.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m tests.sharding.pallas_dep_worker
"""

from __future__ import annotations

import json

import numpy as np
from serving.runtime.programs import Program

PROMPT, DECODE = 12, 2


def kernel_heads(closed_jaxpr, name: str) -> list[int]:
    """The head dimension of the output of every pallas_call `name` in a traced program, as the kernel
    sees it (inside a shard_map: the local shape)."""
    from tests.jaxpr_walk import equations

    return [e.outvars[0].aval.shape[1] for e in equations(closed_jaxpr)  # [T, H, d]
            if e.primitive.name == "pallas_call" and e.params.get("name") == name]


def main() -> None:
    import jax

    import dsv41
    from pallas_kernels.kernel_config import KernelConfig
    from serving.runtime.kv_cache import smallest_block_size
    from serving.runtime.config import RuntimeConfig
    from serving.runtime.runner import Runner
    from sharding.mesh import ParallelConfig
    from sharding.model import ShardedModel
    from sharding.runtime import MeshPlacement
    from tests.serving.driver import Driver

    if jax.device_count() < 4:
        raise SystemExit(f"needs 4 devices, got {jax.device_count()} (XLA_FLAGS not applied?)")
    model = dsv41.random_model("tiny", seed=1)
    c = model.config
    block = smallest_block_size(c)
    rc = RuntimeConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64, block_size=block,
                       token_buckets=(16,), swa_bounded_replay=False, kernel_impl="pallas")
    sm = ShardedModel(model, ParallelConfig(tensor_parallel_size=2, data_parallel_size=2,
                                            enable_expert_parallel=True))
    runner = Runner(sm, rc, progress=False, placement=MeshPlacement(sm.mesh))
    runner.compiler.precompile([Program.SEGMENT1.at(16), Program.SEGMENT2.at(16)])
    tokens = [int(t) for t in np.random.default_rng(0).integers(3, c.vocab_size - 1, PROMPT + DECODE)]
    d = Driver(runner)
    d.start("a", tokens[:PROMPT], rank=1)
    got = [d.step({"a": PROMPT})["a"]]
    for t in tokens[PROMPT:]:
        d.append("a", t)
        got.append(d.step({"a": 1})["a"])
    seg2 = runner.compiler.trace(Program.SEGMENT2.at(16))
    ref = model.with_kernels(KernelConfig(impl="reference")).logits(np.array(tokens))[PROMPT - 1:]
    print(json.dumps({"max_abs_err": float(np.abs(np.stack(got) - ref).max()), "ranks": runner.ranks,
                      "heads": c.num_attention_heads, "sparse_mla_heads_in_seg2": kernel_heads(seg2, "sparse_mla"),
                      "layers_in_seg2": c.num_hidden_layers - c.cut_layer}))


if __name__ == "__main__":
    main()
