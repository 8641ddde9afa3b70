"""The device side of a step: precompiled segment functions over flattened parameter leaves, the KV cache
donated through every call, on-device sampling.

Shapes are bucketed: segment 1 by the step's token count, segment 2 by its kept-row count (the CED
trimming), the sampler once. Every bucket is compiled ahead of time
(`precompile`, with a progress bar); a step whose bucket was not compiled raises instead of compiling in
the serving loop. One step = one host->device call per function and one device->host copy: the tokens
(and, with `expert_counts`, the MoE layers' per-expert token counts in the same copy). `step` = `launch`
(dispatch, returns at once) + `collect` (waits, reads back): the engine does host work between the two.

Data parallelism: with a `placement` of R data-parallel ranks (sharding.runtime.MeshPlacement) every rank
has its own `max_num_seqs` slots, its own blocks and its own batch; a chunk says its rank (`SeqChunk.rank`)
and uses that rank's slot and block ids. The step pads every rank's batch to the same buckets and runs them
all in one call. `max_num_seqs`, `max_num_batched_tokens` and the KV memory are per rank (as vLLM's DP).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import dsv41
from dsv41.layers.moe import set_kernel_impl, set_small_steps
from serving.runtime import exe_cache, kv_cache, map_limit, segments, spec_step
from serving.runtime.config import RuntimeConfig
from serving.runtime.batch import Buckets, EngramHashing, SeqChunk, build_step, token_ladder
from serving.runtime.step import KeptRows, PackedBatch, StepBatch, unpacked
from serving.runtime.decoder_replay import kept_rows
from serving.runtime.encoder_replay import replay_length
from serving.runtime.exe_cache import ExecutableCache, arg_tree
from serving.runtime.kv_cache import CacheLayout
from serving.runtime.sampler import sample_rows, sampling_arrays
from serving.runtime.sampling_params import SamplingParams
from serving.runtime.speculative import SpeculativeConfig


class CompileInServingLoop(RuntimeError):
    """A step needed a shape that was not precompiled."""


class PromptLogprobs(NamedTuple):
    """Per computed row of a chunk: log-probability of the next token [q] and the top ones [q, MAX_LOGPROBS]."""

    logprob: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


class StepOutput(NamedTuple):
    """Per request of the step (rows past the chunk count are dropped)."""

    tokens: np.ndarray  # [n] sampled ids (meaningless where the chunk does not sample)
    logprobs: np.ndarray  # [n]
    top_ids: np.ndarray  # [n, MAX_LOGPROBS]
    top_logprobs: np.ndarray  # [n, MAX_LOGPROBS]
    prompt_logprobs: dict[int, PromptLogprobs]  # chunk index -> its rows' logprobs, for chunks that ask
    expert_counts: np.ndarray | None = None  # [L, E] int32 routed choices of the step's valid rows per MoE layer
    # speculative decoding: tokens / logprobs are [n, J] (top ones [n, J, MAX_LOGPROBS]), of which each request
    # emitted its first num_emitted (accepted drafts, then the bonus token); its next drafts [n, B] and the
    # drafter's confidence in each [n, B]
    num_emitted: np.ndarray | None = None
    drafts: np.ndarray | None = None
    draft_confidence: np.ndarray | None = None


class _Segments(NamedTuple):
    """Both segments of one step, on the devices (nothing read back yet)."""

    kept: KeptRows  # segment 2's host rows (rank-stacked)
    logits: jax.Array  # [ranks x max_num_seqs, V]
    prompt_logprobs: tuple  # segment 2's per-row logprobs (read where a chunk asks)
    expert_counts: tuple  # the two segments' [L, E] counts (None when off)
    rows: list[int]  # each chunk's logits row
    where: list[tuple[int, int]]  # each chunk's (rank, index in the rank)


class LaunchedStep(NamedTuple):
    """A step dispatched by `Runner.launch` whose outputs `Runner.collect` has not read yet."""

    chunks: list[SeqChunk]
    segments: _Segments | None  # None with speculative decoding (its outputs are in `sampled`)
    sampled: object  # the sampler's (or the speculative step's) device outputs


def check_supported(c: dsv41.ModelConfig) -> None:
    """The runtime's CED topology requirements (those of vLLM's decoder replay, spec §3.1). V4 has no CED cut:
    every row runs every layer (segments.split_layer) and nothing is trimmed."""
    if c.family == "v4":
        return
    if c.cut_layer is None:
        raise ValueError("the runtime needs a KV source (kv_source_layer_ids) to split the CED segments")
    cut = c.cut_layer
    if any(lid >= cut for lid in c.engram_layer_ids):
        raise ValueError(f"Engram layers {list(c.engram_layer_ids)} must lie before the CED cut {cut}")
    if c.candidate_source_layer_id is not None and c.candidate_source_layer_id < cut:
        raise ValueError("the candidate source must be at or after the CED cut")


class Runner:
    def __init__(self, model: dsv41.Model, rc: RuntimeConfig = RuntimeConfig(), *, progress: bool = True,
                 placement=None, expert_counts: bool = False):
        """`placement` (sharding.runtime.MeshPlacement): a model on a mesh, run per data-parallel rank;
        None: one device. `expert_counts`: return the MoE layers' per-expert token counts with every step
        (the expert load balancer's signal)."""
        c = model.config
        check_supported(c)
        self.model, self.rc, self.config = model, rc, c
        self.spec = SpeculativeConfig.parse(rc.speculative_config)
        if self.spec is not None:
            self.spec = self.spec.resolve(c)
            if placement is not None:
                raise ValueError("speculative decoding runs on one device for now, not on a mesh (tensor or data "
                                 "parallel)")
        # rows verified per request: the drafter's whole block, so any num_speculative_tokens <= block (the drafts the
        # scheduler gives a chunk) runs the same compiled programs
        self.verify_rows = 1 + c.dspark_block_size if self.spec else 1
        draft_stages = c.num_nextn_predict_layers if self.spec else 0
        memory = rc.kv_cache_memory
        block_size = rc.block_size or kv_cache.smallest_block_size(c, 64)
        probe = CacheLayout(c, 1, block_size, rc.max_num_seqs, rc.kv_cache_dtype, model.dtype.name, draft_stages)
        if memory is None:
            blocks = rc.max_num_seqs * -(-rc.max_model_len // block_size)
            memory = probe.bytes_per_slot() * rc.max_num_seqs + probe.bytes_per_block() * blocks
        # One rank's cache; with R ranks the device arrays hold R of these one after another.
        self.layout = kv_cache.plan_layout(c, memory_bytes=memory, block_size=block_size,
                                           num_slots=rc.max_num_seqs, max_model_len=rc.max_model_len,
                                           fmt=rc.kv_cache_dtype, dtype=model.dtype.name, draft_stages=draft_stages)
        self.placement = placement
        self.ranks = placement.ranks if placement else 1
        self.cache = self.fresh_cache()
        self.max_blocks = -(-rc.max_model_len // block_size)
        self.decoder_replay = c.family == "v41"  # V4 has no CED cut: no chunk is trimmed
        smallest = _smallest_bucket(model.dtype)
        ladder = (tuple(sorted({max(b, smallest) for b in rc.token_buckets})) if rc.token_buckets
                  else token_ladder(rc.max_num_batched_tokens, c.sliding_window, smallest=smallest))
        self.buckets = Buckets(ladder, rc.max_num_seqs, rc.tile)
        set_kernel_impl(model.module, rc.kernel_impl)
        set_small_steps(model.module, rc.moe_small_steps)
        graphdef, state = nnx.split(model.module)
        self._leaves, treedef = jax.tree.flatten(state)
        self._graph = (graphdef, treedef)
        merge = functools.partial(_merge, graphdef, treedef)
        self.expert_counts = expert_counts
        self._engram_hashing = None if model.engram is None else EngramHashing(model.engram, model.token_map)
        kw = dict(fake_quant=rc.fake_quant, expert_counts=expert_counts)

        def seg1(leaves, cache, carry_buf, b, prev_tokens=None, engram_terms=None):  # one rank's cache, carry, batch
            with jax.named_scope("segment1"):
                return segments.segment1(merge(leaves), self.layout, cache, carry_buf, unpacked(b),
                                         prev_tokens=prev_tokens, engram_terms=engram_terms, **kw)

        def seg2(leaves, cache, carry_buf, b):
            with jax.named_scope("segment2"):
                return segments.segment2(merge(leaves), self.layout, cache, carry_buf, unpacked(b), **kw)

        # Compiled programs (and the carry's shapes) kept on disk skip tracing (see exe_cache).
        self.exe_cache = ExecutableCache.for_runner(lambda: repr(
            (c, rc, self.layout, self._graph, arg_tree(self._leaves), expert_counts, self.spec,
             placement and (placement.mesh.shape_tuple, [d.id for d in self._exe_devices()]))))
        # Segment 1 leaves its rows in a persistent buffer of the largest bucket, which segment 2 reads: the
        # kept-row gather then lives in segment 2 and no function is compiled per (tokens, kept rows) pair.
        top = self.buckets.tokens[-1]
        spec = self.exe_cache.get_value("carry") if self.exe_cache else None
        if spec is None:
            b1 = self._build_rank([], token_bucket=top, kept_bucket=top).segment1()
            spec = jax.eval_shape(lambda lv, ca, b: seg1(lv, ca, None, b)[1], self._leaves, self.layout.shapes(), b1)
            if self.exe_cache:
                self.exe_cache.put_value("carry", spec)
        # The sampler runs on each rank's first n logit rows, n a bucket of the step's requests (`sample_rows`).
        self.sample_rows = tuple(sorted({self.buckets.requests(t) for t in self.buckets.tokens}))
        samplers = {n: _sampler(n, self.ranks, rc.max_top_k) for n in self.sample_rows}
        # Segment 1 takes the previous step's sampled tokens (async scheduling; zeros when no row reads them) and,
        # with Engram hash ids, every token's hash term (the device finishes a pending row's ids): on a mesh both
        # replicated, each rank reading its rows' tokens by their global sampled row.
        put = self._put_replicated if placement else jnp.asarray
        self._no_prev = put(np.zeros(self.ranks * rc.max_num_seqs, np.int32))
        self._engram_terms = (() if model.engram is None or model.engram_tables is not None
                              else (put(model.engram.token_terms(model.token_map)),))
        if placement:
            self.carry_buf = placement.zeros(spec)
            cache_sh, carry_sh = (jax.tree.map(lambda a: a.sharding, t) for t in (self.cache, self.carry_buf))
            rep, rows2 = placement.replicated, placement.rows_sharding(2)
            self._fns = {
                "seg1": jax.jit(_named(placement.per_rank(seg1, self._leaves, ("cache", "rows", "sum")), "segment1"),
                                donate_argnums=(1, 2),
                                out_shardings=(cache_sh, carry_sh, rep)),
                # row logprobs replicated: every process can read them (they are zeros unless asked for)
                "seg2": jax.jit(_named(placement.per_rank(seg2, self._leaves, ("cache", "rows", "rows", "sum")),
                                       "segment2"),
                                donate_argnums=1, out_shardings=(cache_sh, rows2, rep, rep)),
                **{("sample", n): jax.jit(f, in_shardings=(rows2, rep), out_shardings=rep)
                   for n, f in samplers.items()}}
        else:
            self.carry_buf = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), spec)
            self._fns = {"seg1": jax.jit(_named(_one_rank(seg1), "segment1"), donate_argnums=(1, 2)),
                         "seg2": jax.jit(_named(_one_rank(seg2), "segment2"), donate_argnums=1),
                         **{("sample", n): jax.jit(f) for n, f in samplers.items()}}
        if self.spec:
            J, spec = self.verify_rows, self.spec

            def snapshot(cache, s):
                return spec_step.snapshot(self.layout, J, cache, s)

            def speculative(leaves, cache, carry_buf, snap, q_buf, logits, s, p):
                return spec_step.finish(merge(leaves), self.layout, spec, cache, carry_buf.tails, snap, q_buf, logits,
                                        s, p, max_top_k=rc.max_top_k, fake_quant=rc.fake_quant)

            # verification and drafting run on the step's requests only, padded to a power of two (a draft pass costs
            # block-size rows per request: padding it to max_num_seqs made a c=1 step 2x a plain one)
            self.spec_rows = tuple(sorted({min(2 ** i, rc.max_num_seqs)
                                           for i in range(rc.max_num_seqs.bit_length() + 1)}))
            self._fns["snapshot"] = jax.jit(_named(snapshot, "spec_snapshot"))
            self._fns["spec"] = jax.jit(_named(speculative, "speculative"), donate_argnums=(1, 4))
            # the draft distributions each slot's drafts were drawn from (rejection sampling reads them)
            self.q_buf = jnp.zeros((rc.max_num_seqs, c.dspark_block_size, c.vocab_size), jnp.float32)
        self._exe: dict[tuple, object] = {}  # filled by precompile (and its background thread)
        self._background: threading.Thread | None = None
        self.progress = progress
        self.compile_seconds = 0.0

    # ----------------------------------------------------------------- compilation
    def _example(self, T: int, T2: int) -> StepBatch:
        ch = SeqChunk(slot=0, block_table=[0], token_ids=[0], start=0, end=1)
        return self._build([ch], token_bucket=T, kept_bucket=T2)[0]

    def _build_rank(self, chunks: Sequence[SeqChunk], **forced) -> StepBatch:
        batch = build_step(chunks, self.buckets, max_blocks=self.max_blocks, window=self.config.sliding_window,
                           block_size=self.layout.block_size, verify_rows=self.verify_rows,
                           decoder_replay=self.decoder_replay, engram=self._engram_hashing, **forced)
        if self.model.engram_tables is not None:  # host tables: the step carries its rows, not their ids
            rows = self.model.engram_tables.gather(batch.rows.engram_TEc, valid=batch.rows.valid_T)  # no padding
            batch = dataclasses.replace(batch, rows=dataclasses.replace(batch.rows, engram_TEc=rows,
                                                                        engram_look_back_RLS2=None))
        return batch

    def _build(self, chunks: Sequence[SeqChunk], token_bucket: int | None = None, kept_bucket: int | None = None
               ) -> tuple[StepBatch, np.ndarray, list[tuple[int, int]]]:
        """The step's batch stacked over the ranks (every rank padded to the same buckets), each chunk's
        logits row in the step's [ranks x max_num_seqs] rows and its (rank, index in the rank)."""
        by_rank: list[list[SeqChunk]] = [[] for _ in range(self.ranks)]
        where = []
        for ch in chunks:
            if not 0 <= ch.rank < self.ranks:
                raise ValueError(f"request in slot {ch.slot}: rank {ch.rank} outside the {self.ranks} "
                                 "data-parallel ranks")
            where.append((ch.rank, len(by_rank[ch.rank])))
            by_rank[ch.rank].append(ch)
        W, sizes = self.config.sliding_window, self.buckets.tokens
        T = token_bucket or self._bucket("seg1", max(sum(ch.num_tokens for ch in r) for r in by_rank), sizes)
        T2 = kept_bucket or self._bucket("seg2", max(
            sum(kept_rows(ch.num_tokens, ch.end, ch.kv_floor, W, ch.trims and self.decoder_replay)[0] for ch in r)
            for r in by_rank), sizes)
        built = [self._build_rank(r, token_bucket=T, kept_bucket=T2) for r in by_rank]
        batch = jax.tree.map(lambda *a: np.stack(a), *built)
        rows = np.array([r * self.rc.max_num_seqs + j for r, j in where], np.int32)
        return batch, rows, where

    def _exe_devices(self) -> list:
        """The devices a compiled program runs on, in its order: the mesh's (a concrete one), or the one device."""
        return list(self.placement.mesh.devices.flat) if self.placement else list(self._leaves[0].devices())

    def _compile(self, key: tuple, fn: str | tuple, *args) -> None:
        map_limit.GUARD.before_compile()  # a clear error, not a crash, where the process runs out of memory maps
        t = time.perf_counter()
        spec = jax.tree.map(_spec, args)
        exe = self.exe_cache.load(key, spec, self._exe_devices()) if self.exe_cache else None
        if exe is None:
            exe = self._fns[fn].lower(*spec).compile()
            if self.exe_cache:
                self.exe_cache.save(key, spec, exe)
        self._exe[key] = exe
        self.compile_seconds += time.perf_counter() - t

    def bucket_keys(self) -> list[tuple]:
        T = self.buckets.tokens
        if self.spec:
            last = [(f, r) for r in self.spec_rows for f in ("snapshot", "spec")]
        else:
            last = [("sample", n) for n in self.sample_rows]
        return [("seg1", t) for t in T] + [("seg2", t) for t in T] + last

    def essential_keys(self) -> list[tuple]:
        """The buckets any step can run on: the largest of each function (a smaller step pads up to it)."""
        largest: dict[str, tuple] = {}
        for key in self.bucket_keys():  # each function's keys in ascending size
            largest[key[0]] = key
        return list(largest.values())

    def precompile(self, keys: Sequence[tuple] | None = None, *, background: bool = False) -> float:
        """Compile every bucket (or `keys`); returns the seconds spent. `background`: compile only the essential
        keys now and the others (smallest first: decode steps gain most) in a daemon thread; until a step's own
        bucket is ready it runs padded to the smallest compiled one that fits (`background_done` tells when all
        are). The serving loop itself still never compiles. A key outside `bucket_keys()` is refused: no step
        would ever run it."""
        known = self.bucket_keys()
        keys = list(keys or known)
        if unused := [k for k in keys if k not in known]:
            raise ValueError(f"bucket keys {unused} are not among this runner's bucket_keys() {known}: no step "
                             "runs them")
        if background:
            now = [k for k in self.essential_keys() if k in keys]
            rest = sorted((k for k in keys if k not in now), key=lambda k: (k[1:] or (0,), k[0]))
            seconds = self.precompile(now)
            self._background = threading.Thread(target=self._compile_rest, args=(rest,), name="precompile",
                                                daemon=True)
            self._background.start()
            return seconds
        start = time.perf_counter()
        for n, key in enumerate(keys):
            if key not in self._exe:
                self._compile_key(key)
            if self.progress:
                _bar(n + 1, len(keys), f"precompiling {key[0]} {key[1:]}", time.perf_counter() - start)
        return time.perf_counter() - start

    def _compile_rest(self, keys: list[tuple]) -> None:
        start = time.perf_counter()
        for key in keys:
            if key not in self._exe:
                self._compile_key(key)
        if self.progress:
            sys.stderr.write(f"[dsv41-jax] background: the other {len(keys)} buckets ready in "
                             f"{time.perf_counter() - start:.1f}s\n")

    @property
    def background_done(self) -> bool:
        return self._background is None or not self._background.is_alive()

    def _bucket(self, fn: str, n: int, sizes: Sequence[int]) -> int:
        """The smallest size >= n whose (fn, size) bucket is compiled; the smallest that fits if none is (the
        step then fails with CompileInServingLoop)."""
        fits = [b for b in sizes if b >= n]
        if not fits:
            raise ValueError(f"{n} tokens exceed the largest token bucket {sizes[-1]}")
        return next((b for b in fits if (fn, b) in self._exe), fits[0])

    def _compile_key(self, key: tuple) -> None:
        name = key[0]
        if name == "seg1":
            b1 = self._example(key[1], key[1]).segment1()
            self._compile(key, "seg1", self._leaves, self.cache, self.carry_buf, self._put_step(b1), *self._prev_arg())
        elif name == "seg2":
            b2 = self._example(key[1], key[1]).segment2()
            self._compile(key, "seg2", self._leaves, self.cache, self.carry_buf, self._put_step(b2))
        elif name == "sample":
            R, V = self.ranks * self.rc.max_num_seqs, self.config.vocab_size
            p = sampling_arrays([], [], R, 0)
            self._compile(key, key, jax.ShapeDtypeStruct((R, V), jnp.float32), p)
        elif name == "snapshot" and self.spec:
            self._compile(key, "snapshot", self.cache, self._spec_inputs([], self._example(1, 1), key[1]))
        elif name == "spec" and self.spec:
            R, V = self.rc.max_num_seqs, self.config.vocab_size
            s = self._spec_inputs([], self._example(1, 1), key[1])
            snap = jax.eval_shape(self._fns["snapshot"], self.cache, s)
            logits = jax.ShapeDtypeStruct((R, self.verify_rows, V), jnp.float32)
            self._compile(key, "spec", self._leaves, self.cache, self.carry_buf, snap, self.q_buf, logits, s,
                          sampling_arrays([], [], key[1], 0))
        else:
            raise ValueError(f"unknown bucket key {key}; keys are ('seg1', T), ('seg2', T) and ('sample', requests), "
                             "or with speculative decoding ('snapshot', requests) and ('spec', requests)")

    def _exe_for(self, key: tuple):
        exe = self._exe.get(key)
        if exe is None:
            raise CompileInServingLoop(f"bucket {key} was not precompiled")
        return exe

    # ------------------------------------------------------------------ inspection
    @property
    def compiled_keys(self) -> list[tuple]:
        """The bucket keys compiled so far (see `bucket_keys`)."""
        return list(self._exe.copy())  # the background compiler may be adding to it

    def fresh_cache(self) -> dict:
        """A KV cache of zeros as at start-up (each rank's layout on its devices): the compiled steps take it as they
        take the current one."""
        p = self.placement
        return p.zeros(self.layout.shapes(), cache=True) if p else kv_cache.allocate(self.layout)

    def compiled_text(self, key: tuple) -> str:
        """The optimised HLO of a compiled bucket (what XLA runs), e.g. to check for sorts or collectives."""
        return self._exe_for(key).as_text()

    def trace(self, key: tuple):
        """The jaxpr (`jax.make_jaxpr`) of a segment bucket on example inputs, e.g. to count kernel calls."""
        name = key[0]
        if name not in ("seg1", "seg2"):
            raise ValueError(f"only segment buckets can be traced, got {key}")
        b = self._example(key[1], key[1])
        return jax.make_jaxpr(self._fns[name])(self._leaves, self.cache, self.carry_buf,
                                               self._put_step(b.segment1() if name == "seg1" else b.segment2()))

    @property
    def param_leaves(self) -> list[jax.Array]:
        """The parameter arrays the compiled steps run on (flattened NNX state)."""
        return self._leaves

    def replay_summary(self) -> str:
        """One line for the banner: what a prefix hit replays and which rows run the layers after the CED cut."""
        c, W, bounded = self.config, self.config.sliding_window, self.rc.swa_bounded_replay
        enc = (f"prefix hits replay their last {W} tokens (bounded)" if bounded
               else f"prefix hits recompute the exact {replay_length(c, False)}-token halo")
        if not self.decoder_replay:
            return f"{enc}; no CED cut in a {c.family} model: every row runs every layer (no decoder trimming)"
        dec = (f"the layers after the CED cut (layer {c.cut_layer}) run each prefill's last {W} rows" if bounded
               else "no decoder trimming")
        return f"{enc}; {dec}"

    def kv_report(self) -> dict:
        """Bytes of the live cache arrays: per token of the paged (prefix-cacheable) groups, per request slot
        of the private ones (SWA rings, tails); `total_bytes` over every data-parallel rank."""
        L, n = self.layout, self.ranks
        paged = sum(a.nbytes for g in ("rows", "keys") for a in self.cache[g].values())
        private = sum(a.nbytes for g in kv_cache.PRIVATE_GROUPS for a in self.cache.get(g, {}).values())
        return {**L.report(), "data_parallel_ranks": n,
                "global_bytes_per_token": paged / (n * L.num_blocks * L.block_size),
                "swa_and_tail_bytes_per_request": private / (n * L.num_slots), "total_bytes": paged + private}

    def reload_params(self) -> None:
        """Take the model module's current parameter values (e.g. after an EPLB weight migration) for the next
        step. The compiled buckets stay: the graph, shapes and shardings must be the ones compiled for."""
        graphdef, state = nnx.split(self.model.module)
        leaves, treedef = jax.tree.flatten(state)
        if (graphdef, treedef) != self._graph:
            raise ValueError("the model's parameter structure changed since the runner was built; the compiled "
                             "steps cannot take it (build a new Runner)")
        for old, new in zip(self._leaves, leaves):
            if (old.shape, old.dtype) != (new.shape, new.dtype) or (
                    isinstance(old, jax.Array) and isinstance(new, jax.Array) and old.sharding != new.sharding):
                raise ValueError(f"a parameter changed from {old.shape} {old.dtype} to {new.shape} {new.dtype} "
                                 "(or its sharding); the compiled steps cannot take it (build a new Runner)")
        self._leaves = leaves

    # ------------------------------------------------------------------ execution
    def _put(self, tree):
        """Host arrays onto the devices: rank-stacked batches split over the ranks (one device: as they are)."""
        return self.placement.put_batch(tree) if self.placement else tree

    def _put_step(self, batch: StepBatch):
        """A segment's batch as its compiled call takes it: one packed array (`PackedBatch`: one transfer, not ~17;
        on a mesh one [ranks, N] array split over the dp axes, each rank unpacking its row inside `per_rank`)."""
        return self._put(PackedBatch.pack(batch))

    def forward(self, chunks: Sequence[SeqChunk]) -> jax.Array:
        """Run one step; the logits [len(chunks), vocab] of each chunk's last row (device array)."""
        seg = self._segments(chunks)
        logits = seg.logits[jnp.asarray(seg.rows)]
        return logits[:, -1] if self.spec else logits  # speculative: [n, J, V], the last being the chunk's last row

    @property
    def async_blocker(self) -> str | None:
        """Why a step cannot be launched before the previous one is collected, its rows reading that step's sampled
        tokens on the device (`SeqChunk.pending_row`); None when it can."""
        return ("speculative decoding" if self.spec
                else "Engram tables in host memory" if self.model.engram_tables is not None else None)

    @property
    def supports_async(self) -> bool:
        return self.async_blocker is None

    def _prev_arg(self, prev: LaunchedStep | None = None) -> tuple:
        """Segment 1's previous-tokens arguments: the sampled tokens [ranks x max_num_seqs] and Engram's terms."""
        return (self._no_prev if prev is None else prev.sampled[0], *self._engram_terms)

    def _segments(self, chunks: Sequence[SeqChunk], built=None, prev: LaunchedStep | None = None) -> _Segments:
        with jax.profiler.TraceAnnotation("runner.build"):
            batch, rows, where = built or self._build(chunks)
        T, K = batch.rows.ids_T.shape[1], batch.kept.row_K.shape[1]
        with jax.profiler.TraceAnnotation("runner.segment1"):
            self.cache, self.carry_buf, counts1 = self._exe_for(("seg1", T))(
                self._leaves, self.cache, self.carry_buf, self._put_step(batch.segment1()), *self._prev_arg(prev))
        with jax.profiler.TraceAnnotation("runner.segment2"):
            self.cache, logits, prompt_lp, counts2 = self._exe_for(("seg2", K))(
                self._leaves, self.cache, self.carry_buf, self._put_step(batch.segment2()))
        return _Segments(batch.kept, logits, prompt_lp, (counts1, counts2), rows, where)

    def step(self, chunks: Sequence[SeqChunk], params: Sequence[SamplingParams | None],
             banned: Sequence[Sequence[int]] | None = None) -> StepOutput:
        """Run one step and sample each request's next token; row logprobs for chunks that ask for them. With
        speculative decoding each request verifies its drafts (`SeqChunk.draft_ids`) and emits 1 .. 1 + k tokens."""
        return self.collect(self.launch(chunks, params, banned))

    def launch(self, chunks: Sequence[SeqChunk], params: Sequence[SamplingParams | None],
               banned: Sequence[Sequence[int]] | None = None, prev: LaunchedStep | None = None) -> LaunchedStep:
        """`step` without its wait: the step's programs are dispatched and the host returns at once, so it can
        work while the device runs (the engine produces the previous step's text then). `collect` waits.
        `prev`: the step launched before this one, not collected yet, whose sampled tokens the chunks with a
        `pending_row` read (async scheduling, `supports_async`)."""
        if any(ch.pending_row >= 0 for ch in chunks) and (prev is None or not self.supports_async):
            raise ValueError("chunks with a pending token need the previous launched step (async scheduling: no "
                             "speculative decoding, no Engram tables in host memory)")
        if self.spec:
            return self._launch_speculative(chunks, params, banned)
        seg = self._segments(chunks, prev=prev)
        n_rows = self.ranks * self.rc.max_num_seqs  # chunk i samples from logits row rows[i]
        row_params, row_pos, row_banned = [None] * n_rows, [0] * n_rows, [[] for _ in range(n_rows)]
        for i, r in enumerate(seg.rows):
            row_params[r], row_pos[r] = params[i], chunks[i].end
            if banned is not None:
                row_banned[r] = list(banned[i])
        p = sampling_arrays(row_params, row_pos, n_rows, self.rc.seed, banned=row_banned)
        with jax.profiler.TraceAnnotation("runner.sample"):
            n = self._bucket("sample", self.buckets.requests(seg.kept.row_K.shape[1]), self.sample_rows)
            sampled = self._exe_for(("sample", n))(seg.logits, self._put_replicated(p))
        return LaunchedStep(list(chunks), seg, tuple(sampled))

    def collect(self, launched: LaunchedStep) -> StepOutput:
        """Wait for a launched step's device work and read its outputs (one device->host copy)."""
        if self.spec:
            return self._collect_speculative(launched)
        chunks, seg = launched.chunks, launched.segments
        with jax.profiler.TraceAnnotation("runner.readback"):
            sampled, counts = jax.device_get((launched.sampled,
                                              seg.expert_counts if self.expert_counts else None))
        tok, logprob, top_ids, top_lp = (a[seg.rows] for a in sampled)
        expert_counts = np.concatenate(counts) if counts is not None else None
        out = {}
        if any(ch.prompt_logprobs for ch in chunks):
            kept, K = seg.kept, seg.kept.row_K.shape[1]
            lp, ids, tlp = (np.asarray(a) for a in seg.prompt_logprobs)
            for i, (ch, (r, j)) in enumerate(zip(chunks, seg.where)):
                if ch.prompt_logprobs:
                    first = r * K + kept.first_R[r, j]
                    sl = slice(first, first + kept.qlen_R[r, j])
                    out[i] = PromptLogprobs(lp[sl], ids[sl], tlp[sl])
        return StepOutput(tok, logprob, top_ids, top_lp, out, expert_counts)

    def _spec_inputs(self, chunks: Sequence[SeqChunk], batch: StepBatch, R: int) -> spec_step.SpecInputs:
        K = self.verify_rows - 1
        i32 = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
        slot, row0, n_draft, first, floor, drafts, active = i32(R), i32(R), i32(R), i32(R), i32(R), i32(R, K), i32(R)
        for j, ch in enumerate(chunks):  # one rank: the chunk's index is its row
            nd = ch.num_draft
            slot[j], row0[j], n_draft[j], floor[j], active[j] = ch.slot, ch.end - 1 - nd, nd, ch.kv_floor, ch.sample
            first[j] = batch.rows.first_R[0, j] + ch.num_tokens - 1 - nd
            drafts[j, :nd] = ch.draft_ids[:nd]
        return spec_step.SpecInputs(slot, row0, n_draft, drafts, first, floor, active.astype(bool),
                                    batch.requests.block_table_RM[0][:R])

    def _launch_speculative(self, chunks: Sequence[SeqChunk], params: Sequence[SamplingParams | None],
                            banned: Sequence[Sequence[int]] | None) -> LaunchedStep:
        if any(ch.prompt_logprobs for ch in chunks):
            raise ValueError("prompt logprobs are not served with speculative decoding")
        R = self._bucket("spec", len(chunks), self.spec_rows)  # the requests' rows bucket
        with jax.profiler.TraceAnnotation("runner.build"):
            built = self._build(chunks)
            s = self._spec_inputs(chunks, built[0], R)
        with jax.profiler.TraceAnnotation("runner.snapshot"):
            snap = self._exe_for(("snapshot", R))(self.cache, s)
        logits = self._segments(chunks, built).logits
        row_params, row_pos, row_banned = [None] * R, [0] * R, [[] for _ in range(R)]
        for i, ch in enumerate(chunks):
            row_params[i], row_pos[i] = params[i], ch.end
            if banned is not None:
                row_banned[i] = list(banned[i])
        p = sampling_arrays(row_params, row_pos, R, self.rc.seed, banned=row_banned)
        with jax.profiler.TraceAnnotation("runner.speculative"):
            self.cache, self.q_buf, out = self._exe_for(("spec", R))(self._leaves, self.cache, self.carry_buf, snap,
                                                                  self.q_buf, logits, s, p)
        return LaunchedStep(list(chunks), None, out)

    def _collect_speculative(self, launched: LaunchedStep) -> StepOutput:
        with jax.profiler.TraceAnnotation("runner.readback"):
            out = jax.device_get(launched.sampled)
        n = len(launched.chunks)
        return StepOutput(out.emitted_RJ[:n], out.logprob_RJ[:n], out.top_ids_RJL[:n], out.top_logprobs_RJL[:n], {},
                          None, out.n_accepted_R[:n] + 1, out.drafts_RB[:n], out.confidence_RB[:n])

    def _put_replicated(self, tree):
        return self.placement.put_replicated(tree) if self.placement else tree


def _smallest_bucket(dtype) -> int:
    """1 row, but 2 for bfloat16 on XLA:CPU: a 1-row bf16 dot misses YNNPACK's matmul (AMX) path and runs ~10x
    slower than a 2-row one ([1, 4096] x [4096, 4096]: 18.9 vs 1.8 ms on this AMX CPU), so a decode of one pads."""
    return 2 if jnp.dtype(dtype) == jnp.bfloat16 and jax.default_backend() == "cpu" else 1


def _sampler(rows: int, ranks: int, max_top_k: int):
    """`sample_rows` on `rows` requests per rank, named `sample` (`jit_sample` in profiles)."""
    def sample(logits_RV, p):
        return sample_rows(logits_RV, p, rows=rows, ranks=ranks, max_top_k=max_top_k)

    return sample


def _named(fn, name: str):
    """The compiled module is named after the function (`jit_segment1` in HLO dumps and profiles, not `jit__lambda`)."""
    fn.__name__ = fn.__qualname__ = name
    return fn


def _one_rank(fn):
    """A rank function over batches stacked for one rank (no mesh): the batch's rank dimension dropped."""
    return lambda leaves, cache, carry, b, *prev: fn(leaves, cache, carry, jax.tree.map(lambda a: a[0], b), *prev)


def _spec(a) -> jax.ShapeDtypeStruct:
    if isinstance(a, jax.ShapeDtypeStruct):
        return a
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding if isinstance(a, jax.Array) else None)


def _merge(graphdef, treedef, leaves):
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


def _bar(done: int, total: int, what: str, seconds: float) -> None:
    width = 24
    fill = int(width * done / total)
    sys.stderr.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{total} {what:<40.40} {seconds:6.1f}s")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def enable_compilation_cache(path: str | None, *, executables: bool = False,
                             max_bytes: int | None = exe_cache.DEFAULT_MAX_BYTES) -> None:
    """Keep compiled buckets on disk, so a restart loads instead of recompiling. Process-wide; `None` or ""
    leaves it off. `executables`: runners (one device or a mesh) keep their programs themselves in
    `path/executables` (`serving.runtime.exe_cache`: a restart also skips tracing) and JAX's cache stays off; else
    JAX's persistent cache of compiled HLO in `path` (multi-process runs). Either keeps at most `max_bytes`,
    deleting the least recently used programs beyond it (None: no bound)."""
    if not path:
        return
    if executables:
        exe_cache.set_folder(Path(path) / "executables", max_bytes)
    else:
        jax.config.update("jax_compilation_cache_dir", str(path))
        jax.config.update("jax_compilation_cache_max_size", -1 if max_bytes is None else max_bytes)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
