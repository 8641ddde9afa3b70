"""What a runner's steps run on, decided and compiled before the first step: the cache layout, the buckets, the
kernels, the step programs (`programs.StepPrograms`) and each bucket's executable.

Buckets: segment 1 by the step's token count, segment 2 by its kept-row count (the CED trimming), the sampler (or
the speculative programs) by its requests. Every bucket is compiled ahead of time (`precompile`, with a progress
bar, one program per core at a time): all of them, or with `background` the essential ones first (the largest of
each family, and the segments at a decode step of 8 rows) and the rest in a daemon thread, a step whose own bucket
is not ready meanwhile running padded to one that is. The serving loop never compiles: a step whose
bucket is missing raises `CompileInServingLoop`. Programs are loaded from and saved to the executable cache
(`serving.runtime.exe_cache`) the moment each is compiled, background ones included.

On a CPU backend a background compile takes a core from the steps (c=8 waves ran at a third of their warm rate beside
it: docs/benchmarks/startup.md), so there it waits for the steps (`BackgroundGate`): a program compiles when the
engine has been idle for a while, or when the steps that padded up for want of it have lost, by their padding, the
seconds it takes to compile (ski rental: at most twice the loss of the better choice made knowing the future).
Programs in the executable cache load at once.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dsv41.layers.basic import with_kernels
from pallas_kernels.kernel_config import KernelConfig, MoeStep
from serving.runtime import kv_cache, map_limit
from serving.runtime.background import BackgroundGate
from serving.runtime.batch import Buckets, token_ladder
from serving.runtime.builder import StepBuilder
from serving.runtime.config import RuntimeConfig
from serving.runtime.exe_cache import ExecutableCache, ExecutableCacheSettings, arg_tree
from serving.runtime.kv_cache import CacheLayout
from serving.runtime.moe_tuning import bucket_kernels, runtime_kernels, small_steps, stored
from serving.runtime.programs import BucketKey, ModelGraph, Program, StepPrograms, build_programs, segment1_rows
from serving.runtime.sampler import sampling_arrays
from serving.runtime.speculative import SpeculativeConfig
from serving.runtime.step import PackedBatch


FEW_ROWS = 8  # a decode step this small has its own essential bucket (`StepCompiler.essential_keys`)


class CompileInServingLoop(RuntimeError):
    """A step needed a shape that was not precompiled."""


class StepCompiler:
    def __init__(self, model, rc: RuntimeConfig, *, placement=None, expert_counts: bool = False,
                 segment1_constants: tuple = (), executable_cache: ExecutableCacheSettings | None = None,
                 progress: bool = True, workers: int | None = None):
        """`placement` (sharding.runtime.MeshPlacement): programs per data-parallel rank on a mesh; None: one
        device. `expert_counts`: the segments also return the MoE layers' per-expert token counts.
        `segment1_constants`: the device arrays segment 1 takes after its batch (the previous step's sampled tokens,
        Engram's token terms), whose shapes and shardings its programs are compiled for. `workers`: programs
        compiled at once before the first step (default: one per core, at most 8; XLA compiles a program mostly on
        one thread)."""
        c = model.config
        self.workers = workers or min(8, os.cpu_count() or 1)
        self.rc, self.config, self.placement, self.progress = rc, c, placement, progress
        self.ranks = placement.ranks if placement else 1
        self.spec = SpeculativeConfig.parse(rc.speculative_config)
        if self.spec is not None:
            self.spec = self.spec.resolve(c)
            if placement is not None:
                raise ValueError("speculative decoding runs on one device for now, not on a mesh (tensor or data "
                                 "parallel)")
        # rows verified per request: the drafter's whole block, so any num_speculative_tokens <= block (the drafts the
        # scheduler gives a chunk) runs the same compiled programs
        self.verify_rows = 1 + c.dspark_block_size if self.spec else 1
        self.layout = plan_layout(c, rc, model.dtype, draft_stages=c.num_nextn_predict_layers if self.spec else 0)
        smallest = _smallest_bucket(model.dtype)
        if rc.token_buckets:
            ladder = kept = tuple(sorted({max(b, smallest) for b in rc.token_buckets}))
        else:
            ladder, kept = (token_ladder(rc.max_num_batched_tokens, c.sliding_window, smallest=smallest,
                                         max_seqs=rc.max_num_seqs, kept=k) for k in (False, True))
        self.buckets = Buckets(ladder, rc.max_num_seqs, rc.tile, kept)
        # The sampler runs on each rank's first n logit rows, n a bucket of the step's requests (`sample_rows`);
        # verification and drafting on the step's requests only, padded to a power of two (a draft pass costs
        # block-size rows per request: padding it to max_num_seqs made a c=1 step far slower than a plain one,
        # docs/design/measurements.md).
        self.sample_rows = tuple(sorted({self.buckets.requests(k) for k in self.buckets.kept}))
        self.spec_rows = _spec_rows(rc) if self.spec else ()
        self.builder = StepBuilder(model, self.layout, self.buckets, ranks=self.ranks,
                                   max_model_len=rc.max_model_len, verify_rows=self.verify_rows)
        settings = executable_cache
        # The programs run the model's module with the runtime's kernels; `model` itself is left as it is. MoE small
        # steps on the XLA path with moe_small_steps="tune" take the form timed for their shape, just before their
        # bucket is traced (`kernels_for`): a bucket compiled in the background is tuned there too.
        self.kernels, self.tune = runtime_kernels(rc)
        self.tuned: dict[MoeStep, str] = {}  # the small-step forms tuned so far
        self._tuning_file = settings.tuning_file if settings else None
        self._module = model.module
        self.graph, leaves = ModelGraph.split(with_kernels(model.module, self.kernels))
        self.param_specs = [_spec(a) for a in leaves]
        self.exe_cache = None if settings is None else ExecutableCache(settings, repr(
            (c, rc, self.spec, self.kernels, self.layout, self.graph, arg_tree(leaves), expert_counts,
             placement and (placement.mesh.shape_tuple, [d.id for d in self.devices]))))
        self.cache_spec = self._global(self.layout.shapes(), cache=True)
        self.constant_specs = tuple(_spec(a) for a in segment1_constants)
        self._rows = segment1_rows(self.layout, rc, expert_counts)
        self.carry_shapes = self._carry_shapes(leaves)  # one rank's
        self.carry_spec = self._global(self.carry_shapes)
        self.programs: StepPrograms = build_programs(
            self.layout, rc, param_specs=self.param_specs, sample_rows_per_rank=self.sample_rows,
            expert_counts=expert_counts, spec=self.spec, verify_rows=self.verify_rows, placement=placement,
            cache=self.cache_spec, carry=self.carry_spec, rows_fn=self._rows)
        self._exe: dict[BucketKey, jax.stages.Compiled] = {}  # filled by precompile (and its background thread)
        self._background: threading.Thread | None = None
        self._not_cached: set[BucketKey] = set()  # looked up in the executable cache, and not there
        slots = min(rc.max_num_seqs, self.buckets.tokens[-1])
        # when the background thread may compile beside the steps (a CPU backend)
        self.gate = BackgroundGate(decode_buckets={Program.SEGMENT1: self.buckets.token_bucket(slots),
                                                   Program.SEGMENT2: self.buckets.kept_bucket(slots)},
                                   few_rows=min(FEW_ROWS, rc.max_num_seqs))
        self.all_compiled_at: float | None = None  # time.perf_counter() when the last bucket was ready
        # (loaded, compiled) of the programs `precompile` handled before it returned (the background's come later)
        self.cache_counts_at_ready: tuple[int, int] | None = None

    # ------------------------------------------------------------------ parameters
    def flatten(self, module) -> list[jax.Array]:
        """The module's current parameter arrays as the compiled programs take them. Refused, naming the change, when
        its structure, a shape, a dtype or a sharding differs from what the programs were compiled for."""
        graph, leaves = ModelGraph.split(with_kernels(module, self.kernels))
        if graph != self.graph:
            raise ValueError("the model's parameter structure changed since the runner was built; the compiled "
                             "steps cannot take it (build a new Runner)")
        for old, new in zip(self.param_specs, leaves):
            if (old.shape, old.dtype) != (new.shape, new.dtype) or (
                    old.sharding is not None and isinstance(new, jax.Array) and old.sharding != new.sharding):
                raise ValueError(f"a parameter changed from {old.shape} {old.dtype} to {new.shape} {new.dtype} "
                                 "(or its sharding); the compiled steps cannot take it (build a new Runner)")
        return leaves

    # ------------------------------------------------------------------ buckets
    def bucket_keys(self) -> list[BucketKey]:
        """Every bucket a step can run on."""
        T, K = self.buckets.tokens, self.buckets.kept
        last = [Program.SAMPLE.at(n) for n in self.sample_rows]  # a speculative runner's plain steps too
        if self.spec:
            last += [p.at(r) for r in self.spec_rows for p in (Program.SPEC_SNAPSHOT, Program.SPEC_FINISH)]
        return [Program.SEGMENT1.at(t) for t in T] + [Program.SEGMENT2.at(k) for k in K] + last

    def essential_keys(self) -> list[BucketKey]:
        """The buckets compiled before the server is ready: the largest of each family (any step can pad up to it),
        and the segments' buckets that hold a decode step of `FEW_ROWS` rows (what padding a decode costs:
        docs/design/measurements.md, "Token buckets"). The background compiles the rest when the engine idles or
        their padding has cost their compile - the decode buckets of every slot at once, when a decode of more
        requests first pads up past them (`BackgroundGate.decode_buckets`): ready sooner for the few-request
        decodes, one compile later for the many-request ones (docs/benchmarks/startup.md)."""
        largest: dict[Program, BucketKey] = {}
        for key in self.bucket_keys():  # each family's keys in ascending size
            largest[key.program] = key
        out = list(largest.values())
        rows = min(FEW_ROWS, self.rc.max_num_seqs)
        for key in (Program.SEGMENT1.at(self.buckets.token_bucket(rows)),
                    Program.SEGMENT2.at(self.buckets.kept_bucket(rows))):
            if key not in out:
                out.append(key)
        return out

    def fit(self, program: Program, n: int, sizes: Sequence[int], requests: int = 0) -> int:
        """The smallest size >= n whose bucket of `program` is compiled; the smallest that fits if none is (the
        step then fails with CompileInServingLoop). `requests`: the step's on its busiest rank (for `gate`)."""
        fits = [b for b in sizes if b >= n]
        if not fits:
            raise ValueError(f"{n} tokens exceed the largest token bucket {sizes[-1]}")
        used = next((b for b in fits if program.at(b) in self._exe), fits[0])
        self.gate.planned(program, fits[0], used, requests)
        return used

    def executable(self, key: BucketKey) -> jax.stages.Compiled:
        exe = self._exe.get(key)
        if exe is None:
            raise CompileInServingLoop(f"bucket {key!r} was not precompiled")
        return exe

    @property
    def compiled_keys(self) -> list[BucketKey]:
        """The buckets compiled so far."""
        return list(self._exe.copy())  # the background compiler may be adding to it

    @property
    def background_done(self) -> bool:
        return self._background is None or not self._background.is_alive()

    # ------------------------------------------------------------------ compilation
    def precompile(self, keys: Sequence[BucketKey] | None = None, *, background: bool = False) -> float:
        """Compile every bucket (or `keys`), `workers` at a time; returns the seconds spent. `background`: compile
        only the essential keys now and the others in a daemon thread: on an accelerator `workers` at a time,
        smallest first (decode steps gain most); on a CPU backend those the executable cache holds are loaded before
        this returns (so `Runner.warm_up` runs them before ready), the others compiled one at a time (two threads,
        or one at the lowest CPU priority, took longer beside a busy serving loop: docs/design/measurements.md),
        each when `gate` lets it. Until a step's own bucket is ready it runs padded to the
        smallest compiled one that fits (`background_done` tells when all are). A key outside `bucket_keys()` is
        refused: no step would ever run it."""
        known = self.bucket_keys()
        keys = list(keys or known)
        if unused := [k for k in keys if k not in known]:
            raise ValueError(f"bucket keys {unused} are not among this runner's bucket_keys() {known}: no step "
                             "runs them")
        if not background:
            seconds = self._compile_all(keys, bar=self.progress)
            self._count_at_ready()
            return seconds
        now = [k for k in self.essential_keys() if k in keys]
        order = list(Program)  # at one size: segments, then what follows them (a snapshot before its finish)
        rest = sorted((k for k in keys if k not in now), key=lambda k: (k.size, order.index(k.program)))
        seconds = self._compile_all(now, bar=self.progress)
        self._count_at_ready()
        if jax.default_backend() == "cpu":  # what the executable cache holds, loaded before ready (`Runner.warm_up`)
            rest = [k for k in rest if (kernels := self._untimed_kernels(k)) is None or not self._load(k, kernels)]
            self._note_if_all_compiled()
            if self.exe_cache is not None:  # loaded before ready too; a lookup that found nothing compiled nothing
                self.cache_counts_at_ready = (self.exe_cache.hits, self.cache_counts_at_ready[1])
        self.gate.start()
        self._background = threading.Thread(target=self._compile_rest, args=(rest,), name="precompile", daemon=True)
        self._background.start()
        return seconds

    def _count_at_ready(self) -> None:
        if self.exe_cache is not None:
            self.cache_counts_at_ready = (self.exe_cache.hits, self.exe_cache.misses)

    def _compile_all(self, keys: list[BucketKey], *, bar: bool, workers: int | None = None) -> float:
        start = time.perf_counter()
        todo = [k for k in keys if k not in self._exe]
        # MoE tuning times kernels eagerly: every bucket's forms are found first, one at a time, before any compile
        # runs beside the timing
        kernels = {k: self.kernels_for(k) for k in todo}
        done = len(keys) - len(todo)
        threads = max(1, min(workers or self.workers, len(todo)))
        with ThreadPoolExecutor(threads, thread_name_prefix="compile") as pool:
            futures = []
            for k in todo:
                # a clear error, not a crash, where the process would run out of memory maps: asked here, one program
                # at a time, so the first refusal starts nothing more
                map_limit.GUARD.before_compile()
                futures.append(pool.submit(lambda k=k: self._compile(k, kernels[k]) or k))
            for key in (f.result() for f in as_completed(futures)):
                done += 1
                if bar:
                    _bar(done, len(keys), f"precompiled {key!r}", time.perf_counter() - start)
        if bar and not todo:
            _bar(len(keys), len(keys), "precompiled (all loaded)", time.perf_counter() - start)
        self._note_if_all_compiled()
        return time.perf_counter() - start

    def _compile_rest(self, keys: list[BucketKey]) -> None:
        start = time.perf_counter()
        if jax.default_backend() != "cpu":  # the steps leave the host's cores to the compiles
            self._compile_all(keys, bar=False)
        else:  # the steps run on the cores a compile would take
            # a program not tuned yet was never compiled with its tuning: not looked up (the timing would run now)
            pending = [k for k in keys if (kernels := self._untimed_kernels(k)) is None or not self._load(k, kernels)]
            self._note_if_all_compiled()
            while pending:
                key = self.gate.wait_next(pending)
                pending.remove(key)
                lost = f"steps lost {self.gate.loss_s[key]:.1f}s padding up for it"
                why = "a decode step padded up past it" if key in self.gate.urgent else \
                    lost if self.gate.due(key) else "engine idle"
                seconds = self._compile_all([key], bar=False, workers=1)
                if self.progress:
                    sys.stderr.write(f"[dsv41-jax] background: {key!r} compiled in {seconds:.1f}s ({why})\n")
        seconds = time.perf_counter() - start
        if self.progress:
            sys.stderr.write(f"[dsv41-jax] background: the other {len(keys)} programs ready {seconds:.1f}s later\n")

    def _note_if_all_compiled(self) -> None:
        if self.all_compiled_at is None and all(k in self._exe for k in self.bucket_keys()):
            self.all_compiled_at = time.perf_counter()

    def _compile(self, key: BucketKey, kernels: KernelConfig) -> None:
        """One bucket's executable, traced with `kernels` (`kernels_for`), loaded or compiled and kept."""
        if self._load(key, kernels):
            return
        start = time.perf_counter()
        exe = self.lower(key, kernels).compile()
        self.gate.compiled(key, time.perf_counter() - start)
        if self.exe_cache:
            self.exe_cache.save(self._cache_name(key, kernels), self.example_args(key), exe)
        self._exe[key] = exe

    def _load(self, key: BucketKey, kernels: KernelConfig) -> bool:
        """Keep the bucket's executable from the executable cache, if it holds it; whether it did (asked once)."""
        if self.exe_cache is None or key in self._not_cached:
            return False
        exe = self.exe_cache.load(self._cache_name(key, kernels), self.example_args(key), self.devices)
        if exe is None:
            self._not_cached.add(key)
            return False
        self._exe[key] = exe
        return True

    def _cache_name(self, key: BucketKey, kernels: KernelConfig):
        return (key, kernels) if self.programs.takes_graph(key) else key  # a program is the kernels it was traced for

    def lower(self, key: BucketKey, kernels: KernelConfig | None = None, **lowering) -> jax.stages.Lowered:
        """A bucket's program traced and lowered for its example arguments, with `kernels` (default: the bucket's,
        `kernels_for`); `lowering`: `Traced.lower`'s options, e.g. lowering_platforms=("cuda",)."""
        static = (self._graph(kernels or self.kernels_for(key)),) if self.programs.takes_graph(key) else ()
        return self.programs.of(key).trace(*static, *self.example_args(key)).lower(**lowering)

    def kernels_for(self, key: BucketKey) -> KernelConfig:
        """The kernels a bucket is traced with: with tuning on, its MoE small steps' forms (timed now where not known
        yet - eagerly, before tracing - or read from the tuning file), else the runner's kernels."""
        if not self.tune or not self.programs.takes_graph(key):
            return self.kernels
        return bucket_kernels(self.kernels, self._module, **self._tuning_rows(key), tuned=self.tuned,
                              tuning_file=self._tuning_file)

    def _untimed_kernels(self, key: BucketKey) -> KernelConfig | None:
        """`kernels_for(key)` where it times nothing (its forms tuned or in the tuning file), else None."""
        if self.tune and self.programs.takes_graph(key):
            missing = [s for s in small_steps(self._module, **self._tuning_rows(key)) if s not in self.tuned]
            if not stored(missing, self._tuning_file):
                return None
        return self.kernels_for(key)

    def _tuning_rows(self, key: BucketKey) -> dict[str, tuple[int, ...]]:
        if key.program is Program.SPEC_FINISH:  # the drafter's block pass: block-size rows per request
            return {"rows": (), "draft_rows": (key.size * self.config.dspark_block_size,)}
        return {"rows": (key.size,), "draft_rows": ()}

    def _graph(self, kernels: KernelConfig) -> ModelGraph:
        return self.graph if kernels == self.kernels else ModelGraph.split(with_kernels(self._module, kernels))[0]

    def describe_kernels(self) -> str:
        """One line for the banner: the implementation and the MoE small-step forms (tuned so far, with tuning)."""
        kernels = dataclasses.replace(self.kernels, moe_small_steps=tuple(self.tuned.items()))
        return kernels.describe() + ("; small steps tuned as their buckets compile" if self.tune else "")

    def example_args(self, key: BucketKey) -> tuple:
        """The arguments (shapes, dtypes, shardings) a bucket is compiled for."""
        return jax.tree.map(_spec, self._example_args(key))

    def _example_args(self, key: BucketKey) -> tuple:
        state = (self.param_specs, self.cache_spec, self.carry_spec)
        p, n = key.program, key.size
        if p is Program.SEGMENT1:
            return (*state, self._batch_spec(self.builder.example(n, n).segment1()), *self.constant_specs)
        if p is Program.SEGMENT2:
            verify = (self.verify_logits_spec,) if self.spec else ()
            return (*state, self._batch_spec(self.builder.example(n, n).segment2()), *verify)
        if p is Program.SAMPLE:
            R = self.ranks * self.rc.max_num_seqs
            return jax.ShapeDtypeStruct((R, self.config.vocab_size), jnp.float32), sampling_arrays([], [], R, 0)
        s = self.builder.spec_inputs([], self.builder.example(1, 1), n)
        if p is Program.SPEC_SNAPSHOT:
            return self.cache_spec, s
        snap = jax.eval_shape(self.programs.spec_snapshot, self.cache_spec, s)
        logits = (jax.ShapeDtypeStruct((self.rc.max_num_seqs, self.config.vocab_size), jnp.float32),
                  self.verify_logits_spec)
        return (*state, snap, self.q_buf_spec, logits, s, sampling_arrays([], [], n, 0))

    @property
    def verify_logits_spec(self) -> jax.ShapeDtypeStruct:
        """Speculative decoding: the logits of each request's verified rows after its first [slots, J - 1, V],
        written by segment 2 only in steps that verify drafts (`segments.segment2`)."""
        return jax.ShapeDtypeStruct((self.rc.max_num_seqs, self.verify_rows - 1, self.config.vocab_size), jnp.float32)

    @property
    def q_buf_spec(self) -> jax.ShapeDtypeStruct:
        """Speculative decoding: the draft distributions each slot's drafts were drawn from [slots, block, V]."""
        c = self.config
        return jax.ShapeDtypeStruct((self.rc.max_num_seqs, c.dspark_block_size, c.vocab_size), jnp.float32)

    # ------------------------------------------------------------------ inspection
    def compiled_text(self, key: BucketKey) -> str:
        """The optimised HLO of a compiled bucket (what XLA runs), e.g. to check for sorts or collectives."""
        return self.executable(key).as_text()

    def trace(self, key: BucketKey):
        """The jaxpr (`jax.make_jaxpr`) of a segment bucket, e.g. to count kernel calls."""
        if key.program not in (Program.SEGMENT1, Program.SEGMENT2):
            raise ValueError(f"only segment buckets can be traced, got {key!r}")
        graph = self._graph(self.kernels_for(key))
        return jax.make_jaxpr(self.programs.of(key), static_argnums=0)(graph, *self.example_args(key))

    # ------------------------------------------------------------------ helpers
    @property
    def devices(self) -> list:
        """The devices a compiled program runs on, in its order: the mesh's, or the parameters' one device."""
        if self.placement:
            return list(self.placement.mesh.devices.flat)
        return list(next(iter(self.param_specs)).sharding.device_set) if self.param_specs else [jax.devices()[0]]

    def _global(self, rank_shapes, *, cache: bool = False):
        """Every rank's copy of `rank_shapes` one after another on the first dimension, with its shardings (on one
        device: as they are)."""
        return self.placement.global_specs(rank_shapes, cache=cache) if self.placement else rank_shapes

    def _batch_spec(self, batch) -> PackedBatch:
        """A segment's batch as its program takes it (packed; on a mesh split over the ranks)."""
        packed = PackedBatch.pack(batch)
        if self.placement:
            packed = self.placement.put_batch(packed)
        return jax.tree.map(_spec, packed)

    def _carry_shapes(self, leaves: list[jax.Array]):
        """One rank's segment carry: segment 1's rows in a persistent buffer of the largest bucket, which segment 2
        reads, so the kept-row gather lives in segment 2 and no program is compiled per (tokens, kept rows) pair.
        Read from the executable cache, or found by tracing `segment1_rows` at the largest bucket: on one device with
        that program's own argument shapes, so the program reuses this trace (JAX keeps a nested jit's trace) and a
        cold start traces segment 1 once per bucket; on a mesh with one rank's unsharded shapes (inside `shard_map`
        the program's differ), apart."""
        cached = self.exe_cache.get_value("carry") if self.exe_cache else None
        if cached is not None:
            return cached
        top = self.buckets.tokens[-1]
        if self.placement is None:
            packed = self._batch_spec(self.builder.example(top, top).segment1())
            rank_batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), packed)  # as `_one_rank`
            args = (self.param_specs, self.cache_spec, rank_batch, *self.constant_specs)
        else:
            args = (leaves, self.layout.shapes(), self.builder.rank_batch([], top, top).segment1())
        shapes = jax.eval_shape(self._rows, self.graph, *args)[1]
        if self.exe_cache:
            self.exe_cache.put_value("carry", shapes)
        return shapes


def plan_layout(c, rc: RuntimeConfig, dtype, *, draft_stages: int) -> CacheLayout:
    """One rank's cache: `rc.kv_cache_memory` bytes, or by default room for max_num_seqs requests of max_model_len."""
    block_size = rc.block_size or kv_cache.smallest_block_size(c, 64)
    memory = rc.kv_cache_memory
    if memory is None:
        probe = CacheLayout(c, 1, block_size, rc.max_num_seqs, rc.kv_cache_dtype, jnp.dtype(dtype).name, draft_stages)
        blocks = rc.max_num_seqs * -(-rc.max_model_len // block_size)
        memory = probe.bytes_per_slot() * rc.max_num_seqs + probe.bytes_per_block() * blocks
    return kv_cache.plan_layout(c, memory_bytes=memory, block_size=block_size, num_slots=rc.max_num_seqs,
                                max_model_len=rc.max_model_len, fmt=rc.kv_cache_dtype, dtype=jnp.dtype(dtype).name,
                                draft_stages=draft_stages)


def enable_compilation_cache(path: str | Path | None, *, max_bytes: int | None = None) -> None:
    """JAX's persistent cache of compiled HLO in `path` (None or "": off), process-wide as JAX keeps it, at most
    `max_bytes` (None: no bound). A restart still traces and lowers every program; a server keeps its programs in
    the executable cache instead (`serving.runtime.exe_cache`), which skips both."""
    if not path:
        return
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_compilation_cache_max_size", -1 if max_bytes is None else max_bytes)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def _spec_rows(rc: RuntimeConfig) -> tuple[int, ...]:
    return tuple(sorted({min(2 ** i, rc.max_num_seqs) for i in range(rc.max_num_seqs.bit_length() + 1)}))


def _smallest_bucket(dtype) -> int:
    """1 row, but 2 for bfloat16 on XLA:CPU: a 1-row bf16 dot misses YNNPACK's matmul path and runs an order of
    magnitude slower than a 2-row one (docs/design/measurements.md), so a decode of one pads."""
    return 2 if jnp.dtype(dtype) == jnp.bfloat16 and jax.default_backend() == "cpu" else 1


def _spec(a) -> jax.ShapeDtypeStruct:
    if isinstance(a, jax.ShapeDtypeStruct):
        return a
    return jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=a.sharding if isinstance(a, jax.Array) else None)


def _bar(done: int, total: int, what: str, seconds: float) -> None:
    width = 24
    fill = int(width * done / total)
    sys.stderr.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{total} {what:<40.40} {seconds:6.1f}s")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()
