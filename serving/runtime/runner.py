"""The executor of steps: each step's host inputs built (`builder.StepBuilder`), the compiled programs launched on
the device state - the parameter leaves, the KV cache (donated through every call), segment 1's carry and, with
speculative decoding, the draft distributions - and the outputs collected.

One step = one host->device call per program and one device->host copy: the tokens (and, with `expert_counts`, the
MoE layers' per-expert token counts in the same copy). `step` = `launch` (dispatch, returns at once) + `collect`
(waits, reads back): the engine does host work between the two. `launch` = `plan` (every host input of the step, a
numpy-only `HostStep`) + `execute` (the dispatch): a server on several processes plans on process 0 and executes
the same `HostStep` on every process (serving.engine.multiprocess). Plain and speculative steps take the same path;
they differ in the programs around the two segments (`_SampleFinish`: the sampler; `_SpeculativeFinish`: the
cache snapshot before, verification, rollback and drafting after). A runner with speculative decoding runs both,
which one chosen per step (`speculate`; the engine's speculation policy picks).

What the steps run on - cache layout, buckets, kernels, programs and their executables - is the compiler's
(`runner.compiler`, `serving.runtime.compiler.StepCompiler`); `runner.compiler.precompile()` compiles every bucket
before the first step, and a step whose bucket was not compiled raises instead of compiling in the serving loop.

Data parallelism: with a `placement` of R data-parallel ranks (sharding.runtime.MeshPlacement) every rank
has its own `max_num_seqs` slots, its own blocks and its own batch; a chunk says its rank (`SeqChunk.rank`)
and uses that rank's slot and block ids. The step pads every rank's batch to the same buckets and runs them
all in one call. `max_num_seqs`, `max_num_batched_tokens` and the KV memory are per rank (as vLLM's DP).
"""

from __future__ import annotations

import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import dsv41
from serving.runtime.batch import SeqChunk
from serving.runtime.builder import BuiltStep
from serving.runtime.compiler import StepCompiler
from serving.runtime.config import RuntimeConfig
from serving.runtime.encoder_replay import replay_length
from serving.runtime.exe_cache import ExecutableCacheSettings
from serving.runtime.kv_cache import KVCache
from serving.runtime.outputs import (HostStep, LaunchedStep, PromptLogprobs, SampleInputs, SegmentsOnDevice,
                                     SpecHostInputs, SpeculativeStepOutput, StepOutput)
from serving.runtime.programs import Program
from serving.runtime.rollback import CacheSites
from serving.runtime.sampler import Sampled, sampling_arrays
from serving.runtime.sampling_params import SamplingParams
from serving.runtime.spec_step import SpecOutput
from serving.runtime.step import PackedBatch


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
                 placement=None, expert_counts: bool = False, executable_cache: ExecutableCacheSettings | None = None):
        """`placement` (sharding.runtime.MeshPlacement): a model on a mesh, run per data-parallel rank; None: one
        device. `expert_counts`: return the MoE layers' per-expert token counts with every step (the expert load
        balancer's signal). `executable_cache`: keep the compiled programs there (a restart loads them)."""
        c = model.config
        check_supported(c)
        self.model, self.rc, self.config, self.placement = model, rc, c, placement
        self.expert_counts = expert_counts
        self.ranks = placement.ranks if placement else 1
        # Segment 1 takes the previous step's sampled tokens (async scheduling; zeros when no row reads them) and,
        # with Engram hash ids, every token's hash term (the device finishes a pending row's ids): on a mesh both
        # replicated, each rank reading its rows' tokens by their global sampled row.
        put = self._put_replicated if placement else jnp.asarray
        self._no_prev = put(np.zeros(self.ranks * rc.max_num_seqs, np.int32))
        self._engram_terms = (() if model.engram is None or model.engram_tables is not None
                              else (put(model.engram.token_terms(model.token_map)),))
        self.compiler = StepCompiler(model, rc, placement=placement, expert_counts=expert_counts,
                                     segment1_constants=(self._no_prev, *self._engram_terms),
                                     executable_cache=executable_cache, progress=progress)
        self.layout, self.buckets, self.spec = self.compiler.layout, self.compiler.buckets, self.compiler.spec
        self._builder = self.compiler.builder
        self.param_leaves: list[jax.Array] = self.compiler.flatten(model.module)
        self.cache: KVCache = self.fresh_cache()
        self.carry_buf = self._zeros(self.compiler.carry_shapes)
        self.q_buf = self._zeros(self.compiler.q_buf_spec) if self.spec else None  # [slots, block, V]
        # [slots, J - 1, V]: donated to segment 2, which writes it only in steps verifying drafts
        self.verify_buf = self._zeros(self.compiler.verify_logits_spec) if self.spec else None
        # a speculative runner also runs plain steps (the sampler on each request's first logits row), which the
        # engine picks when verifying drafts would not pay (serving.engine.spec_policy)
        self._sample = _SampleFinish(self)
        self._speculate = _SpeculativeFinish(self) if self.spec else None

    # ------------------------------------------------------------------ state
    def fresh_cache(self) -> KVCache:
        """A KV cache of zeros as at start-up (each rank's layout on its devices): the compiled steps take it as they
        take the current one."""
        p = self.placement
        return p.zeros(self.layout.shapes(), cache=True) if p else self.layout.zeros()

    def warm_up(self) -> float:
        """On XLA:CPU, run every program compiled so far once, before any request: XLA:CPU builds each dot's YNNPACK
        executable at a program's first run, not at compile or load (docs/benchmarks/startup.md), and that would
        land on the first steps that use it. The segments run on the example batch (one one-token request in slot 0,
        block 0) through this runner's own state, which then starts again from zeros; the samplers on zero logits.
        The seconds it took."""
        if jax.default_backend() != "cpu" or self.placement:  # one CPU device: a mesh's arrays are laid out apart
            return 0.0
        start = time.perf_counter()
        keys = self.compiler.compiled_keys
        sizes = {p: sorted(k.size for k in keys if k.program is p) for p in (Program.SEGMENT1, Program.SEGMENT2)}
        t_sizes, k_sizes = sizes[Program.SEGMENT1], sizes[Program.SEGMENT2]
        example = SeqChunk(slot=0, block_table=[0], token_ids=[0], start=0, end=1)
        outs = []
        for i in range(max(len(t_sizes), len(k_sizes)) if t_sizes and k_sizes else 0):
            T, K = t_sizes[min(i, len(t_sizes) - 1)], k_sizes[min(i, len(k_sizes) - 1)]
            outs.append(self._segments(self._builder.build(*self._builder.split([example]), T, K)).logits)
        for key in (k for k in keys if k.program is Program.SAMPLE):
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self.compiler.example_args(key))
            outs.append(self.compiler.executable(key)(*zeros))
        jax.block_until_ready(outs)
        self.cache = None  # dropped before its replacement is allocated
        self.cache = self.fresh_cache()
        self.carry_buf = self._zeros(self.compiler.carry_shapes)
        if self.verify_buf is not None:
            self.verify_buf = self._zeros(self.compiler.verify_logits_spec)
        return time.perf_counter() - start

    def reload_params(self) -> None:
        """Take the model module's current parameter values (e.g. after an EPLB weight migration) for the next
        step. The compiled buckets stay: the graph, shapes and shardings must be the ones compiled for."""
        self.param_leaves = self.compiler.flatten(self.model.module)

    @property
    def decoder_replay(self) -> bool:
        """Whether chunks can be trimmed after the CED cut (V4.1; V4 has no cut)."""
        return self._builder.decoder_replay

    @property
    def max_blocks(self) -> int:
        """Block-table entries of a request of max_model_len."""
        return self._builder.max_blocks

    @property
    def async_blocker(self) -> str | None:
        """Why a step cannot be launched before the previous one is collected, its rows reading that step's sampled
        tokens on the device (`SeqChunk.pending_row`); None when it can."""
        return "Engram tables in host memory" if self.model.engram_tables is not None else None

    @property
    def supports_async(self) -> bool:
        return self.async_blocker is None

    # ------------------------------------------------------------------ steps
    def step(self, chunks: Sequence[SeqChunk], params: Sequence[SamplingParams | None],
             banned: Sequence[Sequence[int]] | None = None, *, speculate: bool | None = None
             ) -> StepOutput | SpeculativeStepOutput:
        """Run one step and sample each request's next token; row logprobs for chunks that ask for them. A
        speculative step (`speculate`, default: whether the runner has speculative decoding) verifies each request's
        drafts (`SeqChunk.draft_ids`), emits 1 .. 1 + k tokens and drafts the next block."""
        return self.collect(self.launch(chunks, params, banned, speculate=speculate))

    def launch(self, chunks: Sequence[SeqChunk], params: Sequence[SamplingParams | None],
               banned: Sequence[Sequence[int]] | None = None, prev: LaunchedStep | None = None, *,
               speculate: bool | None = None) -> LaunchedStep:
        """`step` without its wait: the step's programs are dispatched and the host returns at once, so it can
        work while the device runs (the engine produces the previous step's text then). `collect` waits.
        `prev`: the step launched before this one, not collected yet, whose sampled tokens the chunks with a
        `pending_row` read (async scheduling, `supports_async`; plain steps only)."""
        return self.execute(self.plan(chunks, params, banned, prev, speculate=speculate), prev, chunks)

    def plan(self, chunks: Sequence[SeqChunk], params: Sequence[SamplingParams | None],
             banned: Sequence[Sequence[int]] | None = None, prev: LaunchedStep | None = None, *,
             speculate: bool | None = None) -> HostStep:
        """Everything the step's programs take from the host (no device work): what the engine on several
        processes sends to the other ranks, each of which `execute`s it on its devices."""
        speculate = bool(self.spec) if speculate is None else speculate
        if speculate and not self.spec:
            raise ValueError("a speculative step needs a runner with speculative decoding (speculative_config)")
        if any(ch.pending_row >= 0 for ch in chunks) and (prev is None or not self.supports_async or speculate):
            raise ValueError("chunks with a pending token need the previous launched step (async scheduling: plain "
                             "steps only, no Engram tables in host memory)")
        if not speculate and any(ch.num_draft for ch in chunks):
            raise ValueError("a plain step verifies no drafts (speculate=True does)")
        finish = self._speculate if speculate else self._sample
        finish.check(chunks)
        with jax.profiler.TraceAnnotation("runner.build"):
            built = self._build(chunks)
            return HostStep(built, finish.inputs(chunks, built, params, banned))

    def execute(self, host: HostStep, prev: LaunchedStep | None = None, chunks: Sequence[SeqChunk] = ()
                ) -> LaunchedStep:
        """Dispatch a planned step's programs (returns at once). `chunks`: the step's, for `collect`."""
        finish = self._speculate if isinstance(host.finish, SpecHostInputs) else self._sample
        before = finish.before_segments(host.finish)
        seg = self._segments(host.built, prev)
        return LaunchedStep(list(chunks), seg, finish.after_segments(seg, host.finish, before))

    def collect(self, launched: LaunchedStep) -> StepOutput | SpeculativeStepOutput:
        """Wait for a launched step's device work and read its outputs (one device->host copy)."""
        with jax.profiler.TraceAnnotation("runner.readback"):
            sampled, counts = jax.device_get((launched.sampled,
                                              launched.segments.expert_counts if self.expert_counts else None))
        finish = self._speculate if isinstance(launched.sampled, SpecOutput) else self._sample
        return finish.collect(launched, sampled, np.concatenate(counts) if counts is not None else None)

    def forward(self, chunks: Sequence[SeqChunk]) -> jax.Array:
        """Run the segments of one step; the logits [len(chunks), vocab] of each chunk's last row (device array)."""
        with jax.profiler.TraceAnnotation("runner.build"):
            built = self._build(chunks)
        seg = self._segments(built)
        rows = jnp.asarray(seg.rows)
        if not self.spec:
            return seg.logits[rows]
        last = jnp.asarray([ch.num_draft for ch in chunks])  # a chunk's last row: its row num_draft of J
        rest = jnp.concatenate([seg.logits[:, None], seg.verify_logits], axis=1)[rows]
        return jnp.take_along_axis(rest, last[:, None, None], axis=1)[:, 0]

    def _build(self, chunks: Sequence[SeqChunk]) -> BuiltStep:
        """The step's batch on the smallest compiled buckets that hold its busiest rank."""
        by_rank, where = self._builder.split(chunks)
        tokens, kept = self._builder.demand(by_rank)
        b, requests = self.buckets, max(len(r) for r in by_rank)
        return self._builder.build(by_rank, where, self.compiler.fit(Program.SEGMENT1, tokens, b.tokens, requests),
                                   self.compiler.fit(Program.SEGMENT2, kept, b.kept, requests))

    def _segments(self, built: BuiltStep, prev: LaunchedStep | None = None) -> SegmentsOnDevice:
        batch = built.batch
        T, K = batch.rows.ids_T.shape[1], batch.kept.row_K.shape[1]
        prev_tokens = self._no_prev if prev is None else prev.sampled.tokens_R
        with jax.profiler.TraceAnnotation("runner.segment1"):
            self.cache, self.carry_buf, counts1 = self.compiler.executable(Program.SEGMENT1.at(T))(
                self.param_leaves, self.cache, self.carry_buf, self._put_step(batch.segment1()), prev_tokens,
                *self._engram_terms)
        verify = () if self.verify_buf is None else (self.verify_buf,)
        with jax.profiler.TraceAnnotation("runner.segment2"):
            self.cache, logits, prompt_lp, counts2 = self.compiler.executable(Program.SEGMENT2.at(K))(
                self.param_leaves, self.cache, self.carry_buf, self._put_step(batch.segment2()), *verify)
        if verify:
            logits, self.verify_buf = logits
        return SegmentsOnDevice(batch.kept, logits, self.verify_buf, prompt_lp, (counts1, counts2), built.rows,
                                built.where)

    # ------------------------------------------------------------------ reports
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
        paged = sum(a.nbytes for a in self.cache.paged())
        private = sum(a.nbytes for a in self.cache.private())
        return {**L.report(), "data_parallel_ranks": n,
                "global_bytes_per_token": paged / (n * L.num_blocks * L.block_size),
                "swa_and_tail_bytes_per_request": private / (n * L.num_slots), "total_bytes": paged + private}

    # ------------------------------------------------------------------ transfers
    def _zeros(self, rank_shapes):
        """Zero arrays of one rank's shapes, every rank's one after another on a mesh."""
        if self.placement:
            return self.placement.zeros(rank_shapes)
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), rank_shapes)

    def _put_step(self, batch):
        """A segment's batch as its compiled call takes it: one packed array (`PackedBatch`: one transfer, not ~17;
        on a mesh one [ranks, N] array split over the dp axes, each rank unpacking its row inside `per_rank`)."""
        packed = PackedBatch.pack(batch)
        return self.placement.put_batch(packed) if self.placement else packed

    def _put_replicated(self, tree):
        return self.placement.put_replicated(tree) if self.placement else tree


class _SampleFinish:
    """Plain decoding: after segment 2, the sampler on the step's requests' logit rows."""

    def __init__(self, runner: Runner):
        self.r = runner

    def check(self, chunks: Sequence[SeqChunk]) -> None:
        pass

    def inputs(self, chunks: Sequence[SeqChunk], built: BuiltStep, params: Sequence[SamplingParams | None],
               banned: Sequence[Sequence[int]] | None) -> SampleInputs:
        r = self.r
        n_rows = r.ranks * r.rc.max_num_seqs  # chunk i samples from logits row rows[i]
        row_params, row_pos, row_banned = [None] * n_rows, [0] * n_rows, [[] for _ in range(n_rows)]
        for i, row in enumerate(built.rows):
            row_params[row], row_pos[row] = params[i], chunks[i].end
            if banned is not None:
                row_banned[row] = list(banned[i])
        p = sampling_arrays(row_params, row_pos, n_rows, r.rc.seed, banned=row_banned)
        K = built.batch.kept.row_K.shape[1]
        return SampleInputs(p, r.compiler.fit(Program.SAMPLE, r.buckets.requests(K), r.compiler.sample_rows))

    def before_segments(self, inputs: SampleInputs) -> None:
        return None

    def after_segments(self, seg: SegmentsOnDevice, inputs: SampleInputs, before: None) -> Sampled:
        r = self.r
        with jax.profiler.TraceAnnotation("runner.sample"):
            return r.compiler.executable(Program.SAMPLE.at(inputs.rows))(seg.logits, r._put_replicated(inputs.params))

    def collect(self, launched: LaunchedStep, sampled: Sampled, expert_counts: np.ndarray | None) -> StepOutput:
        chunks, seg = launched.chunks, launched.segments
        rows = seg.rows
        prompt = {}
        if any(ch.prompt_logprobs for ch in chunks):
            kept, K = seg.kept, seg.kept.row_K.shape[1]
            lp, ids, tlp = (np.asarray(a) for a in seg.prompt_logprobs)
            for i, (ch, (rank, j)) in enumerate(zip(chunks, seg.where)):
                if ch.prompt_logprobs:
                    first = rank * K + kept.first_R[rank, j]
                    sl = slice(first, first + kept.qlen_R[rank, j])
                    prompt[i] = PromptLogprobs(lp[sl], ids[sl], tlp[sl])
        return StepOutput(sampled.tokens_R[rows], sampled.logprob_R[rows], sampled.top_ids_RL[rows],
                          sampled.top_logprobs_RL[rows], prompt, expert_counts)


class _SpeculativeFinish:
    """Speculative decoding (serving.runtime.spec_step): before segment 1 the cache sites the verified rows will
    write are snapshot; after segment 2 each request's drafts are verified, the rejected rows rolled back and the
    next block drafted, on the step's requests padded to a bucket."""

    def __init__(self, runner: Runner):
        self.r = runner

    def check(self, chunks: Sequence[SeqChunk]) -> None:
        if any(ch.prompt_logprobs for ch in chunks):
            raise ValueError("prompt logprobs are not served with speculative decoding")

    def inputs(self, chunks: Sequence[SeqChunk], built: BuiltStep, params: Sequence[SamplingParams | None],
               banned: Sequence[Sequence[int]] | None) -> SpecHostInputs:
        r = self.r
        R = r.compiler.fit(Program.SPEC_FINISH, len(chunks), r.compiler.spec_rows)  # the requests' rows bucket
        row_params, row_pos, row_banned = [None] * R, [0] * R, [[] for _ in range(R)]
        for i, ch in enumerate(chunks):
            row_params[i], row_pos[i] = params[i], ch.end
            if banned is not None:
                row_banned[i] = list(banned[i])
        return SpecHostInputs(r.compiler.builder.spec_inputs(chunks, built.batch, R),
                              sampling_arrays(row_params, row_pos, R, r.rc.seed, banned=row_banned))

    def before_segments(self, h: SpecHostInputs) -> CacheSites:
        r = self.r
        with jax.profiler.TraceAnnotation("runner.snapshot"):
            return r.compiler.executable(Program.SPEC_SNAPSHOT.at(len(h.spec.slot_R)))(r.cache, h.spec)

    def after_segments(self, seg: SegmentsOnDevice, h: SpecHostInputs, snap: CacheSites) -> SpecOutput:
        r = self.r
        with jax.profiler.TraceAnnotation("runner.speculative"):
            r.cache, r.q_buf, out = r.compiler.executable(Program.SPEC_FINISH.at(len(h.spec.slot_R)))(
                r.param_leaves, r.cache, r.carry_buf, snap, r.q_buf, (seg.logits, seg.verify_logits), h.spec, h.params)
        return out

    def collect(self, launched: LaunchedStep, out: SpecOutput, expert_counts: np.ndarray | None
                ) -> SpeculativeStepOutput:
        n = len(launched.chunks)
        return SpeculativeStepOutput(out.emitted_RJ[:n], out.logprob_RJ[:n], out.top_ids_RJL[:n],
                                     out.top_logprobs_RJL[:n], out.n_accepted_R[:n] + 1, out.drafts_RB[:n],
                                     out.confidence_RB[:n], expert_counts=expert_counts)
