"""Run in a subprocess with 8 virtual CPU devices: the engine on the DEP8 tiny model (8 data-parallel ranks,
EPLB with 8 experts in 16 slots) against the single-device engine, same greedy requests: a first turn of
three sessions (routed to ranks by the sticky DP router), then a second turn of each session whose prompt
extends the first turn's (it must land on the same rank and hit that rank's prefix cache).

Then a dp4 x tp2 engine without EPLB (async scheduling) serves the first turn.

Prints one JSON object: both engines' tokens and cached-token counts per turn, each request's rank, the
steps after which EPLB rearranged and the placements, the async engine's scheduling line, tokens and ranks,
the compiled buckets before and after serving, whether the runner runs the migrated weights, and the rendered
`dsv41:*` metric lines.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.sharding.dep_engine_worker
"""

from __future__ import annotations

import argparse
import json

import numpy as np

INTERVAL, WINDOW, PROMPTS, MAX_TOKENS = 3, 4, (60, 58, 62), 6  # turn 2 hits 64 tokens (> the 56 replayed)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compilation-cache-dir", default="", help="persistent XLA cache (the tests' one)")
    cli = ap.parse_args()

    import jax

    import dsv41
    from serving.engine.args import EngineArgs
    from serving.engine.engine import Engine
    from serving.runtime.kv_cache import smallest_block_size
    from serving.runtime.compiler import enable_compilation_cache
    from serving.runtime.sampling_params import SamplingParams

    if jax.device_count() < 8:
        raise SystemExit(f"needs 8 devices, got {jax.device_count()} (XLA_FLAGS not applied?)")
    enable_compilation_cache(cli.compilation_cache_dir)
    model = dsv41.random_model("tiny", seed=1)
    c = model.config
    block = smallest_block_size(c)
    base = EngineArgs.of(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128, block_size=block,
                         token_buckets=(16,), swa_bounded_replay=False)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, c.vocab_size - 1, n)] for n in PROMPTS]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

    ref_engine = Engine(model, None, base, progress=False)
    ref = _serve(ref_engine, prompts, greedy)
    turn2 = [p + out + [int(t) for t in rng.integers(3, c.vocab_size - 1, 5)] for p, out in zip(prompts, ref["tokens"])]
    ref2 = _serve(ref_engine, turn2, greedy, turn=2)

    args = base.replace(data_parallel_size=8, enable_expert_parallel=True, enable_eplb=True, eplb_window_size=WINDOW,
                        eplb_step_interval=INTERVAL, eplb_num_redundant_experts=c.n_routed_experts)
    eng = Engine(model, None, args, progress=False)  # DEP8: the engine shards the model on the 8 devices
    compiled_before = sorted(map(str, eng.runner.compiler.compiled_keys))
    placements = [eng.eplb.state.placement.phys_to_log.tolist()]
    rearranged_at = []
    n_steps = 0

    def on_step():
        nonlocal n_steps
        n_steps += 1
        if eng.eplb.state.rearrangements > len(rearranged_at):
            rearranged_at.append(n_steps)
            placements.append(eng.eplb.state.placement.phys_to_log.tolist())

    ranks = {}
    got = _serve(eng, prompts, greedy, ranks=ranks, on_step=on_step)
    steps_turn1 = n_steps
    got2 = _serve(eng, turn2, greedy, turn=2, ranks=ranks, on_step=on_step)
    metrics = [ln for ln in eng.metrics.render().decode().splitlines() if ln.startswith("dsv41:")]
    # without EPLB the mesh engine schedules async: each rank's pending rows read their tokens on the device
    dp = Engine(model, None, base.replace(data_parallel_size=4, tensor_parallel_size=2), progress=False)
    dp_ranks = {}
    dp_async = {"scheduling": dp.scheduling_summary(), **_serve(dp, prompts, greedy, ranks=dp_ranks),
                "ranks": sorted(set(dp_ranks.values()))}
    print(json.dumps({"ref": ref, "eplb": got, "dp_async": dp_async, "ref_turn2": ref2, "dep_turn2": got2,
                      "ranks": ranks,
                      "steps_turn1": steps_turn1, "steps": n_steps, "eplb_steps": eng.eplb.state.steps,
                      "rearranged_at": rearranged_at, "placements": placements,
                      "balancedness": eng.eplb.state.balancedness(),
                      "before_after": [eng.eplb.state.last_balancedness_before,
                                       eng.eplb.state.last_balancedness_after],
                      "compiled_before": compiled_before, "compiled_after": sorted(map(str, eng.runner.compiler.compiled_keys)),
                      "runner_runs_model_leaves": all(a is b for a, b in zip(eng.runner.param_leaves, eng.model.leaves())),
                      "metrics": metrics}))


def _serve(engine, prompts, params, *, turn: int = 1, ranks: dict | None = None, on_step=None) -> dict:
    """Session i's turn: {"tokens": [...] per session, "cached": [...] cached prompt tokens per session}."""
    names = [f"s{i}-t{turn}" for i in range(len(prompts))]
    for i, (name, p) in enumerate(zip(names, prompts)):
        req = engine.add_request(name, p, params, session_id=f"s{i}")
        if ranks is not None:
            ranks[name] = req.rank
    out = {n: [] for n in names}
    cached = {}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            if o.finished:
                cached[o.request_id] = o.num_cached_tokens
        if on_step:
            on_step()
    return {"tokens": [out[n] for n in names], "cached": [cached[n] for n in names]}


if __name__ == "__main__":
    main()
