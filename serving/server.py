"""`python -m serving.server`: vLLM-style flags -> model, engine (precompiled), and the HTTP server (the entry point
that puts the layers together: model loading, the engine, the API)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "dsv41-jax", "xla")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m serving.server",
                                description="OpenAI-compatible server for DeepSeek-V4.1 models on JAX.")
    a = p.add_argument
    a("--model", default=None, help="checkpoint folder (release safetensors or converted), or a preset name; "
                                    "default: the built-in tiny model with random weights")
    a("--served-model-name", default=None, help="model id clients send (default: the folder or preset name)")
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=8000)
    a("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    a("--dtype", default="float32", choices=["float32", "bfloat16"])
    a("--seed", type=int, default=0, help="random weights of presets, and the engine's sampling seed")
    a("--max-num-seqs", type=int, default=32, help="running requests per data-parallel rank")
    a("--max-num-batched-tokens", type=int, default=512, help="tokens per step per data-parallel rank")
    a("--max-model-len", type=int, default=4096)
    a("--block-size", type=int, default=64)
    a("--kv-cache-dtype", default="auto", choices=["auto", "release"],
      help="auto: compute dtype; release: FP8 SWA / NVFP4 global / MXFP4 indexer records")
    a("--kv-cache-memory", type=int, default=None, help="bytes for the KV cache per data-parallel rank (default: "
                                                       "max-num-seqs requests of max-model-len)")
    a("--token-buckets", type=_int_list, default=None,
      help="comma-separated step sizes to compile (default: powers of two, then window multiples 1-2-3-4-6-8...)")
    a("--swa-bounded-replay", action=argparse.BooleanOptionalAction, default=True)
    a("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    a("--long-prefill-token-threshold", type=int, default=0, help="cap on one request's prefill tokens per step")
    a("--max-queued-requests", type=int, default=4096, help="waiting requests beyond this get HTTP 503")
    a("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    a("--max-request-body-bytes", type=int, default=32 << 20)
    a("--compilation-cache-dir", default=DEFAULT_CACHE, help="persistent XLA cache ('' turns it off)")
    a("--disable-access-log", action="store_true")
    a("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    from serving.engine.dp_router import POLICIES
    from sharding.mesh import ParallelConfig

    ParallelConfig.add_arguments(p)
    p.add_argument("--num-cpu-devices", type=int, default=None,
                   help="on the CPU backend: split the host into this many devices (to run parallel layouts "
                        "without accelerators)")
    p.add_argument("--dp-routing-policy", default="sticky", choices=POLICIES,
                   help="data-parallel ranks: keep a session (X-Session-ID, else its prompt's first tokens) on the "
                        "rank holding its prefix cache unless saturated (sticky), or always the least-loaded rank")
    p.add_argument("--dp-max-inflight", type=int, default=None,
                   help="requests in flight (running or waiting) that saturate a data-parallel rank for sticky "
                        "routing (default: 2 x --max-num-seqs)")
    g = p.add_argument_group("expert load balancing (EPLB; needs --enable-expert-parallel)")
    g.add_argument("--enable-eplb", action="store_true",
                   help="record per-expert load every step and rearrange the experts over the expert-parallel "
                        "ranks every --eplb-step-interval steps (hot experts replicated into redundant slots)")
    g.add_argument("--eplb-window-size", type=int, default=1000, help="steps of load the rearrangement looks at")
    g.add_argument("--eplb-step-interval", type=int, default=3000, help="steps between rearrangements")
    g.add_argument("--eplb-num-redundant-experts", type=int, default=0,
                   help="extra expert slots over all ranks (n_routed_experts + this must divide over the ranks)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    say = _say
    t0 = time.perf_counter()
    say("loading ...")
    import uvicorn

    from serving.api.server import build_app
    from serving.engine.async_engine import AsyncEngine
    from serving.engine.engine import Engine, EngineArgs
    from serving.model_source import load_model
    from serving.runtime.runner import enable_compilation_cache

    enable_compilation_cache(args.compilation_cache_dir)
    if args.num_cpu_devices is not None:
        if args.num_cpu_devices < 1:
            sys.exit(f"error: --num-cpu-devices must be >= 1, got {args.num_cpu_devices}")
        import jax

        jax.config.update("jax_num_cpu_devices", args.num_cpu_devices)
    try:
        if args.enable_eplb and not args.enable_expert_parallel:
            raise ValueError("--enable-eplb needs --enable-expert-parallel (experts split over the ranks)")
        src = load_model(args.model, args.dtype, args.seed)
        engine_args = EngineArgs(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                 max_model_len=args.max_model_len, block_size=args.block_size,
                                 kv_cache_dtype=args.kv_cache_dtype, kv_cache_memory=args.kv_cache_memory,
                                 swa_bounded_replay=args.swa_bounded_replay,
                                 enable_prefix_caching=args.enable_prefix_caching,
                                 long_prefill_token_threshold=args.long_prefill_token_threshold,
                                 max_queued_requests=args.max_queued_requests,
                                 scheduling_policy=args.scheduling_policy, seed=args.seed,
                                 token_buckets=args.token_buckets, eplb=args.enable_eplb,
                                 eplb_window_size=args.eplb_window_size, eplb_step_interval=args.eplb_step_interval,
                                 eplb_num_redundant_experts=args.eplb_num_redundant_experts,
                                 dp_routing_policy=args.dp_routing_policy, dp_max_inflight=args.dp_max_inflight)
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    name = args.served_model_name or src.name
    say(f"model: {src.description}")
    model, placement = src.model, None
    if args.tensor_parallel_size * args.data_parallel_size > 1:
        from sharding.mesh import ParallelConfig
        from sharding.model import ShardedModel
        from sharding.runtime import MeshPlacement

        try:
            pc = ParallelConfig.from_args(args)
            model = ShardedModel(src.model, pc)
        except ValueError as e:
            sys.exit(f"error: {e}")
        placement = MeshPlacement(model.mesh)
        say(f"parallel layout: {pc.describe()}")
    say(f"loaded in {time.perf_counter() - t0:.1f}s; precompiling the step buckets "
        f"(cached in {args.compilation_cache_dir or 'memory only'}) ...")
    engine = Engine(model, src.tokenizer, engine_args, model_name=name, progress=True, placement=placement)
    kv = engine.runner.kv_report()
    per_rank = f" ({engine.runner.ranks} data-parallel ranks)" if engine.runner.ranks > 1 else ""
    say(f"KV cache: {engine.scheduler.num_blocks} blocks of {args.block_size} tokens{per_rank}, "
        f"{kv['total_bytes'] / 2**20:.1f} MiB; {len(engine.runner.buckets.tokens)} token buckets "
        f"compiled in {engine.runner.compile_seconds:.1f}s")
    aengine = AsyncEngine(engine)
    app = build_app(aengine, src.tokenizer, model_name=name, max_model_len=args.max_model_len, api_key=args.api_key,
                    max_body_bytes=args.max_request_body_bytes)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=not args.disable_access_log, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)

    async def serve():
        aengine.start(asyncio.get_running_loop())
        ready = asyncio.create_task(_announce(server, f"http://{args.host}:{args.port}", name, t0))
        try:
            await server.serve()
        finally:
            ready.cancel()
            aengine.shutdown()

    asyncio.run(serve())


async def _announce(server, url: str, name: str, t0: float) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    _say(f"ready in {time.perf_counter() - t0:.1f}s: serving {name!r} at {url}/v1 (OpenAI API), "
         f"{url}/health, {url}/metrics")


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _say(msg: str) -> None:
    print(f"[dsv41-jax] {msg}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
