"""Run in a subprocess with 8 virtual CPU devices: the engine with EPLB on the DEP8 tiny model (8 experts,
8 redundant slots: two per rank) against the single-device engine without it, same greedy requests.

Prints one JSON object: both engines' tokens, the steps after which EPLB rearranged and the placements,
the compiled buckets before and after serving, whether the runner runs the migrated weights, and the
rendered `dsv41:eplb_*` metric lines.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.sharding.eplb_engine_worker
"""

from __future__ import annotations

import argparse
import json

import numpy as np

INTERVAL, WINDOW, PROMPTS, MAX_TOKENS = 3, 4, (12, 9, 14), 6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compilation-cache-dir", default="", help="persistent XLA cache (the tests' one)")
    cli = ap.parse_args()

    import jax

    import dsv41
    from serving.engine.engine import Engine, EngineArgs
    from serving.runtime.runner import enable_compilation_cache
    from serving.sampling_params import SamplingParams
    from sharding.mesh import ParallelConfig
    from sharding.model import ShardedModel
    from sharding.runtime import MeshPlacement

    if jax.device_count() < 8:
        raise SystemExit(f"needs 8 devices, got {jax.device_count()} (XLA_FLAGS not applied?)")
    enable_compilation_cache(cli.compilation_cache_dir)
    model = dsv41.random_model("tiny", seed=1)
    c = model.config
    block = max(8, max(c.compress_ratios) * c.candidate_block_size)  # whole candidate blocks per page
    base = EngineArgs(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, block_size=block,
                      token_buckets=(16,), swa_bounded_replay=False)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, c.vocab_size - 1, n)] for n in PROMPTS]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

    ref = _serve(Engine(model, None, base, progress=False), prompts, greedy)

    sm = ShardedModel(model, ParallelConfig(1, 8, True))
    args = EngineArgs(**{**base.__dict__, "eplb": True, "eplb_window_size": WINDOW, "eplb_step_interval": INTERVAL,
                         "eplb_num_redundant_experts": c.n_routed_experts})
    eng = Engine(sm, None, args, progress=False, placement=MeshPlacement(sm.mesh))
    compiled_before = sorted(map(str, eng.runner._exe))
    placements = [eng.eplb.state.placement.phys_to_log.tolist()]
    rearranged_at = []
    tokens = {}
    n_steps = 0
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, greedy)
    while eng.has_unfinished():
        for o in eng.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        n_steps += 1
        if eng.eplb.state.rearrangements > len(rearranged_at):
            rearranged_at.append(n_steps)
            placements.append(eng.eplb.state.placement.phys_to_log.tolist())
    got = [tokens[f"r{i}"] for i in range(len(prompts))]
    metrics = [ln for ln in eng.metrics.render().decode().splitlines() if ln.startswith("dsv41:eplb_")]
    print(json.dumps({"ref": ref, "eplb": got, "steps": n_steps, "eplb_steps": eng.eplb.state.steps,
                      "rearranged_at": rearranged_at, "placements": placements,
                      "balancedness": eng.eplb.state.balancedness(),
                      "before_after": [eng.eplb.state.last_balancedness_before,
                                       eng.eplb.state.last_balancedness_after],
                      "compiled_before": compiled_before, "compiled_after": sorted(map(str, eng.runner._exe)),
                      "runner_runs_model_leaves": all(a is b for a, b in zip(eng.runner._leaves, sm.leaves())),
                      "metrics": metrics}))


def _serve(engine, prompts, params) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    out = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[f"r{i}"] for i in range(len(prompts))]


if __name__ == "__main__":
    main()
