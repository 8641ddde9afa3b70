"""`python -m serving.server`: vLLM-style flags -> model, engine (precompiled), and the HTTP server (the entry point
that puts the layers together: model loading, the engine, the API).

The flags are generated from three kinds of dataclass: `ModelArgs` (what to serve), `ServerArgs` (HTTP and the
process) and the sections of `EngineArgs`; `--help` lists them by section.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from typing import NamedTuple

from serving.api.server import ServerArgs
from serving.engine.args import EngineArgs, FlagError, add_flags, from_flags, to_flags
from serving.model_source import ModelArgs
from serving.runtime.host_memory import keep_freed_memory
from serving.text.template_kwargs import ChatTemplateKwargs


class ServeArgs(NamedTuple):
    model: ModelArgs
    server: ServerArgs
    engine: EngineArgs

    def to_cli_args(self) -> list[str]:
        """Flags that parse back to these values (defaults left out)."""
        return to_flags(self.model) + to_flags(self.server) + self.engine.to_flags()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m serving.server",
                                description="OpenAI-compatible server for DeepSeek-V4.1 models on JAX.")
    add_flags(p, ModelArgs, "model: what to serve")
    add_flags(p, ServerArgs, "server: HTTP, logging, compilation cache")
    EngineArgs.add_flags(p)
    return p


def parse_args(argv: list[str] | None = None) -> ServeArgs:
    """The flags as sections; a bad value exits with a usage error naming its flag (status 2)."""
    p = parser()
    ns = p.parse_args(argv)
    try:
        return ServeArgs(from_flags(ModelArgs, ns), from_flags(ServerArgs, ns), EngineArgs.from_flags(ns))
    except FlagError as e:
        p.error(str(e))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    srv, ea = args.server, args.engine
    logging.basicConfig(level=srv.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    t0 = time.perf_counter()
    _say("loading ...")
    if srv.keep_host_memory and (why := keep_freed_memory()):  # before anything starts JAX's backends
        _say(f"host memory: freed memory is returned to the OS ({why})")
    from serving.engine import multiprocess  # imports no backend

    pc = ea.parallel
    pc.use_cpu_devices()  # before anything starts JAX's backends
    if pc.nnodes > 1:
        multiprocess.join(pc)  # also before the backends
        _say(f"process {pc.node_rank} of {pc.nnodes} (coordinator {pc.dist_init_addr})")
        try:
            multiprocess.check_same_settings(_shared_settings(args), pc.node_rank, pc.nnodes)
        except ValueError as e:
            sys.exit(f"error: {e}")
    import uvicorn

    from serving.api.response_store import ResponseStore
    from serving.api.server import build_app
    from serving.engine.async_engine import AsyncEngine
    from serving.engine.engine import Engine
    from serving.model_source import load_model
    from serving.runtime.exe_cache import ExecutableCacheSettings

    # the server keeps its step programs in the executable cache (a restart skips tracing as well as compiling)
    cache_dir, background = srv.compilation_cache_dir, srv.background_compile
    if pc.nnodes > 1 and background:  # see serving.engine.multiprocess
        _say("every step program compiles before ready: every process must hold the buckets process 0 picks")
        background = False
    exe_cache = ExecutableCacheSettings.in_cache_dir(cache_dir, srv.compilation_cache_max_bytes)
    leader = pc.node_rank == 0
    try:
        src = load_model(args.model, ea.runtime.seed, ea.parallel, progress=True)
        _say(f"model: {src.description}")
        _say(f"loaded in {time.perf_counter() - t0:.1f}s; precompiling the step buckets "
             f"(cached in {cache_dir or 'memory only'}) ...")
        channel = multiprocess.StepChannel() if pc.nnodes > 1 and leader else None
        engine = Engine(src.model, src.tokenizer, ea, model_name=src.name, progress=True,
                        background_compile=background, executable_cache=exe_cache, step_channel=channel)
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    if pc.nnodes > 1:
        multiprocess.wait_for_every_rank("compiled")
        if not leader:
            _follow(engine, pc, t0)  # does not return
    if ea.parallel.world_size > 1:
        _say(f"parallel layout: {ea.parallel.describe()}")
    kv = engine.runner.kv_report()
    per_rank = f" ({engine.runner.ranks} data-parallel ranks)" if engine.runner.ranks > 1 else ""
    compiled = len(engine.runner.compiler.compiled_keys)
    compiler = engine.runner.compiler
    rest = ("" if compiler.background_done else
            f" ({compiled} of {len(compiler.bucket_keys())} programs compiled before ready, the others compiling)")
    _say(f"KV cache: {engine.scheduler.num_blocks} blocks of {engine.scheduler.block_size} tokens{per_rank}, "
         f"{kv['total_bytes'] / 2**20:.1f} MiB; token buckets {list(engine.runner.buckets.tokens)}, kept-row "
         f"buckets {list(engine.runner.buckets.kept)}{rest}")
    _say(f"replay: {engine.runner.replay_summary()}")
    _say(f"kernels: {engine.runner.compiler.describe_kernels()}")
    _say(f"scheduling: {engine.scheduling_summary()}")
    if engine.warm_up_s:
        _say(f"warm-up: each program ready so far run once in {engine.warm_up_s:.1f}s (XLA:CPU builds a program's "
             "dot kernels at its first run)")
    if (counts := engine.runner.compiler.cache_counts_at_ready) is not None:
        _say(f"executable cache: {counts[0]} programs loaded, {counts[1]} compiled "
             f"({engine.runner.compiler.exe_cache.folder})")
    aengine = AsyncEngine(engine)
    chat_defaults, stated_by = _chat_defaults(srv, src)
    _say(f"chat: a request that states nothing about thinking gets {chat_defaults.describe()} ({stated_by})")
    app = build_app(aengine, src.tokenizer, model_name=src.name, max_model_len=ea.runtime.max_model_len,
                    api_key=srv.api_key, max_body_bytes=srv.max_request_body_bytes, profile_dir=srv.profile_dir,
                    chat_defaults=chat_defaults,
                    response_store=ResponseStore(srv.responses_store_max_entries, srv.responses_store_max_bytes))
    config = uvicorn.Config(app, host=srv.host, port=srv.port, log_level=srv.log_level,
                            access_log=not srv.disable_access_log, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)

    watch = _watch_processes(pc, aengine) if pc.nnodes > 1 else None
    async def serve():
        aengine.start(asyncio.get_running_loop())
        if watch is not None:
            watch.start()
        ready = asyncio.create_task(_announce(server, f"http://{srv.host}:{srv.port}", src.name, t0, compiler))
        try:
            await server.serve()
        finally:
            ready.cancel()
            aengine.shutdown()
            if app.state.profiler.active:  # a trace still running at shutdown is written, not lost
                _say(f"trace written to {app.state.profiler.stop().folder}")

    asyncio.run(serve())
    if pc.nnodes > 1:  # a clean stop: every other process exits too
        watch.stop()
        channel.publish(multiprocess.Stop("process 0 stopped"))
        multiprocess.shutdown()


def _shared_settings(args: ServeArgs) -> dict:
    """What every process of a server on several processes must agree on: the model's and the engine's settings,
    but the process's own rank (and its CPU device count, checked by the mesh)."""
    own = {"node_rank", "num_cpu_devices"}
    engine = {k: v for k, v in args.engine.flat().items() if k not in own}
    return {**{f.name: getattr(args.model, f.name) for f in dataclasses.fields(args.model)}, **engine}


def _follow(engine, pc, t0: float) -> None:
    """A process other than 0 of a server on several processes: run process 0's steps, then exit."""
    from serving.engine import multiprocess

    _say(f"process {pc.node_rank}: compiled in {time.perf_counter() - t0:.1f}s; running process 0's steps")
    code = multiprocess.follow(engine.runner, multiprocess.StepChannel(), pc.node_rank)
    if code == 0:
        multiprocess.shutdown()
    _say(f"process {pc.node_rank}: exiting with status {code}")
    os._exit(code)  # the runtime's threads (collectives, coordination) do not hold the exit


def _watch_processes(pc, aengine):
    """Process 0: the watch over the other processes (not started). A dead one fails the engine - 503 to new and
    waiting requests, an error event to open streams, /health names it - and this process exits 1 soon after."""
    from serving.engine import multiprocess

    def dead(err: BaseException) -> None:
        aengine.fail(err)
        _say(f"{err}; exiting with status 1 in {multiprocess.EXIT_GRACE_S:.0f} s")
        threading.Timer(multiprocess.EXIT_GRACE_S, os._exit, args=(1,)).start()

    # uvicorn re-raises a stop signal once it has shut down: caught here instead, the other processes are told to
    # stop after `serve` returns and this one exits 0
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: None)
    return multiprocess.ProcessWatch(pc.nnodes, pc.dead_rank_timeout, dead)


def _chat_defaults(srv: ServerArgs, src) -> tuple[ChatTemplateKwargs, str]:
    """The chat-template defaults in force and who stated them: the flag, else the checkpoint, else the recipe."""
    if (flag := srv.chat_template_defaults) is not None:
        return flag, "--default-chat-template-kwargs"
    if src.chat_template_kwargs is not None:
        return src.chat_template_kwargs, "the checkpoint's tokenizer_config.json chat_template_kwargs"
    return ChatTemplateKwargs(), "V4.1's recipe; --default-chat-template-kwargs changes it"


async def _announce(server, url: str, name: str, t0: float, compiler) -> None:
    """'ready' when the server answers, then 'all programs compiled' when the last step bucket is (full speed:
    until then a step whose bucket is still compiling runs padded to a larger one, beside the compiler)."""
    while not server.started:
        await asyncio.sleep(0.05)
    _say(f"ready in {time.perf_counter() - t0:.1f}s: serving {name!r} at {url}/v1 (OpenAI API), "
         f"{url}/health, {url}/metrics")
    while compiler.all_compiled_at is None:
        await asyncio.sleep(0.25)
    _say(f"all programs compiled {compiler.all_compiled_at - t0:.1f}s after launch "
         f"({len(compiler.compiled_keys)} step programs)")


def _say(msg: str) -> None:
    print(f"[dsv41-jax] {msg}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
