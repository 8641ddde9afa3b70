"""DP routing through the real engine: a closed-loop multi-turn agentic workload served by one engine with
data-parallel ranks (each its own prefix cache), once per routing policy, side by side.

Every session keeps one request in flight: when a turn finishes, the next turn's prompt is the previous
prompt + its answer + a new message, sent with the session's `X-Session-ID` (or without it:
`--no-session-header`, then the router keys by the prompt's first tokens). Prints a table and one JSON
object: per policy the prefix-cache hit rate (cached / prompt tokens, as vLLM's `prefix_cache_hits /
queries`), the share of sessions with >= 95% of turns on one rank, the router's moves off saturated ranks,
output tokens per second and wall time. `--profile-dir DIR`: a `jax.profiler` trace of each policy's timed run
(engine construction and compilation left out).

    python -m serving.bench.dp_engine --num-cpu-devices 4 --data-parallel-size 4 --enable-expert-parallel \\
        --sessions 16 --turns 4 [--out dp_engine.json]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

from serving.bench.dp_router import emit, routing_result


def run(model, args, a: argparse.Namespace) -> dict:
    """One policy's run: `args` the engine's sections (the policy among them), `a` the workload."""
    from serving.engine.engine import Engine
    from serving.engine.profiler import profiling
    from serving.runtime.sampling_params import SamplingParams

    engine = Engine(model, None, args, progress=False)
    rng = np.random.default_rng(args.runtime.seed)
    vocab = model.config.vocab_size

    def tokens(lo, hi):
        return [int(t) for t in rng.integers(3, vocab - 1, int(rng.integers(lo, hi)))]

    history = {s: tokens(a.prompt_min, a.prompt_max) for s in range(a.sessions)}
    turn = dict.fromkeys(range(a.sessions), 0)
    ranks: dict[int, list[int]] = {s: [] for s in range(a.sessions)}
    out: dict[str, list[int]] = {}
    prompt_tokens = cached_tokens = generated = 0

    def submit(s: int) -> None:
        nonlocal prompt_tokens
        params = SamplingParams(temperature=0, max_tokens=int(rng.integers(a.answer_min, a.answer_max)),
                                ignore_eos=True)
        rid = f"s{s}-t{turn[s]}"
        req = engine.add_request(rid, history[s], params, session_id=None if a.no_session_header else f"s{s}")
        ranks[s].append(req.rank)
        out[rid] = []
        prompt_tokens += len(history[s])

    with profiling(a.profile_dir, f"dp_engine_{args.scheduler.dp_routing_policy}"):
        t0 = time.perf_counter()
        for s in range(a.sessions):
            submit(s)
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id] += o.new_token_ids
                generated += len(o.new_token_ids)
                if o.finished:
                    cached_tokens += o.num_cached_tokens
                    s = int(o.request_id[1:].split("-")[0])
                    turn[s] += 1
                    if turn[s] < a.turns:
                        history[s] = history[s] + out[o.request_id] + tokens(a.message_min, a.message_max)
                        submit(s)
        wall = time.perf_counter() - t0
    return {**routing_result(args.scheduler.dp_routing_policy, cached_tokens, prompt_tokens, ranks.values(),
                             engine.scheduler.router.moved), "prompt_tokens": prompt_tokens,
            "cached_tokens": cached_tokens, "output_tokens": generated, "output_tok_per_s": generated / wall,
            "wall_s": wall, "requests_per_rank": [sum(r.count(k) for r in ranks.values())
                                                  for k in range(engine.runner.ranks)]}


def main() -> None:
    from serving.engine.args import EngineArgs, FlagError

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--prompt-min", type=int, default=64)
    ap.add_argument("--prompt-max", type=int, default=256)
    ap.add_argument("--message-min", type=int, default=16)
    ap.add_argument("--message-max", type=int, default=64)
    ap.add_argument("--answer-min", type=int, default=8)
    ap.add_argument("--answer-max", type=int, default=24)
    ap.add_argument("--no-session-header", action="store_true")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--profile-dir", default=None, help="write a jax.profiler trace of each policy's run here")
    # the engine's own flags (both routing policies run, so that one is not a flag here), small by default
    EngineArgs.add_flags(ap, exclude=("dp_routing_policy",))
    ap.set_defaults(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=1024, block_size=16)
    a = ap.parse_args()
    try:
        args = EngineArgs.from_flags(a)
    except FlagError as e:
        ap.error(str(e))
    if args.runtime.token_buckets is None:  # decode rows and full prefill chunks: two compiled step sizes
        args = args.replace(token_buckets=(args.runtime.max_num_seqs, args.runtime.max_num_batched_tokens))
    args.parallel.use_cpu_devices()
    import dsv41
    from serving.engine.dp_router import POLICIES
    from serving.runtime.compiler import enable_compilation_cache

    cache_dir = tempfile.TemporaryDirectory(prefix="dp-engine-xla-")  # removed when main returns
    enable_compilation_cache(cache_dir.name)  # the second engine loads the first's steps
    model = dsv41.random_model(a.preset, seed=args.runtime.seed)
    res = {"layout": args.parallel.describe(), "workload": {k: getattr(a, k) for k in (
        "sessions", "turns", "prompt_min", "prompt_max", "message_min", "message_max", "answer_min", "answer_max",
        "no_session_header")}}
    for policy in POLICIES:
        res[policy] = run(model, args.replace(dp_routing_policy=policy), a)
    print(f"{res['layout']}; {a.sessions} sessions x {a.turns} turns")
    print(f"{'policy':<8} {'prefix hit':>10} {'sticky>=95%':>12} {'moves':>6} {'out tok/s':>10} {'wall s':>7}  per rank")
    for p in POLICIES:
        r = res[p]
        print(f"{p:<8} {r['prefix_hit_rate']:>10.3f} {r['sessions_with_95pct_turns_on_one_rank']:>12.2f} "
              f"{r['sticky_moves_when_saturated']:>6} {r['output_tok_per_s']:>10.1f} {r['wall_s']:>7.1f}  "
              f"{r['requests_per_rank']}")
    emit(res, a.out)


if __name__ == "__main__":
    main()
