"""The synchronous engine core: requests in, one step at a time, per-request deltas out.

`step()` = scheduler decides the chunks -> the runner runs them (one call per segment, one device->host copy)
-> the scheduler registers the written blocks, appends the sampled tokens, decides the finishes and frees the
finished requests (`Scheduler.postprocess`, the one place a request ends other than an abort) -> the output
handling reports: text and logprobs of the appended tokens, under the scheduler's finish.
The async server and the offline `LLM` both drive this class; only one thread may call it.

The output handling of a step overlaps the next step: once a step's tokens are appended and its finishes applied,
the next step is scheduled and dispatched, and only then is the text made (vLLM overlaps the same work by
detokenizing in another process). A stop string is only known from text, so a request that has stop strings has
its step's new tokens decoded before the scheduler's postprocess (`OutputState.find_stop`); the scheduler appends,
cuts after the stop string and finishes once, and the reporting reuses that text.

Async scheduling (`SchedulerConfig.async_scheduling`, vLLM's `--async-scheduling`) goes one step further: step
n + 1 is scheduled and dispatched before step n is collected. Each request that samples in step n has one pending
token (`Request.num_pending`); its row in step n + 1 reads that token from step n's sampled tokens on the device
(`SeqChunk.pending_row`), so the host's scheduling, batch building and dispatch overlap the device's work. A length
limit is known in advance (no row follows the last token); any other finish (EOS, a stop id, a stop string) drops
the row already dispatched, and the blocks the request frees are only reused by steps after it (the device runs
steps in order). Outputs are the same as step by step. V4.1's Engram hash ids of such a row are
finished on the device from the host's look-back (`dsv41.layers.engram`). On a mesh every rank reads the replicated
sampled tokens by global row. It needs no EPLB or Engram tables in host memory (their rows are gathered by the host;
elsewhere steps go one at a time), and with speculative decoding it takes the plain steps only.

Speculative decoding (`--speculative-config`): before each step the speculation policy
(`serving.engine.spec_policy`) picks how many drafts it verifies per request, k in 0..num_speculative_tokens, from
the output rates measured at this concurrency. k = 0 is a plain step (the sampler, the drafts dropped, async
scheduling kept); k >= 1 verifies the requests' drafts - each request up to its own share of k, by its acceptance
and the measured cost of a row (`serving.engine.draft_allocation`) - and drafts the next block, and goes after the
step before it is collected (its drafts are read from that step).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import NamedTuple

import jax
import numpy as np

import dsv41
from serving.engine.args import EngineArgs
from serving.engine.dp_scheduler import DataParallelScheduler
from serving.engine.draft_allocation import DraftAllocator, RequestDrafts
from serving.engine.eplb import EngineEplb
from serving.engine.metrics import EngineMetrics
from serving.engine.multiprocess import Execute, Rebalance, StepChannel
from serving.engine.output import OutputState
from serving.engine.request import Finish, Request, RequestOutput, TokenLogprob
from serving.engine.scheduler import Scheduled
from serving.engine.spec_policy import SpeculationPolicy
from serving.runtime.batch import SeqChunk
from serving.runtime.exe_cache import ExecutableCacheSettings
from serving.runtime.outputs import LaunchedStep, SpeculativeStepOutput, StepOutput
from serving.runtime.runner import Runner
from serving.runtime.sampling_params import SamplingParams
from sharding.model import ShardedModel
from sharding.runtime import MeshPlacement

log = logging.getLogger("serving.engine")


class _InFlight(NamedTuple):
    """A dispatched step: what was scheduled, the runner's handle to its device work and, with async scheduling,
    which chunks left a pending token (`Scheduler.launched`)."""

    sched: list[Scheduled]
    launched: LaunchedStep
    pending: list[bool] | None = None
    k: int = 0  # drafts verified per request at most (0: a plain step)
    decode: bool = False  # decode rows only (the speculation policy measures these)


class Engine:
    def __init__(self, model: dsv41.Model, tokenizer=None, args: EngineArgs = EngineArgs(), *,
                 model_name: str = "dsv41", progress: bool = True, background_compile: bool = False,
                 executable_cache: ExecutableCacheSettings | None = None, step_channel: StepChannel | None = None):
        """With `args.parallel` over more than one device the engine shards the model on that mesh
        (`sharding.model.ShardedModel`; the runner runs its segments per data-parallel rank in a `shard_map`): each
        rank has its own slots, blocks and batch, requests go to ranks by `dp_routing_policy`, and `args.eplb` may
        balance the experts. `background_compile`: `StepCompiler.precompile(background=True)` (the server's default).
        `executable_cache`: where the runner keeps its compiled programs. `step_channel`: rank 0 of a server on
        several processes publishes each step's host inputs there for the other ranks
        (`serving.engine.multiprocess`)."""
        placement = None
        if args.parallel.world_size > 1:
            model = ShardedModel(model, args.parallel)
            placement = MeshPlacement(model.mesh)
        self.model, self.tokenizer, self.args = model, tokenizer, args
        self.metrics = EngineMetrics(model_name)
        # before the runner: EPLB's first placement is part of the graph the runner compiles
        self.eplb = EngineEplb(model, args.eplb, self.metrics) if args.eplb.enable_eplb else None
        self.runner = Runner(model, args.runtime, progress=progress, placement=placement,
                             expert_counts=args.eplb.enable_eplb, executable_cache=executable_cache)
        self.runner.compiler.precompile(background=background_compile)
        self.warm_up_s = self.runner.warm_up()  # seconds: each program compiled so far run once (XLA:CPU)
        self.spec = self.runner.spec
        self.spec_policy = None
        if self.spec:
            self.metrics.add_spec_decode(self.spec.num_speculative_tokens)
            self.spec_policy = SpeculationPolicy(self.spec.num_speculative_tokens, adaptive=self.spec.adaptive,
                                                 step_shape=self._decode_shape)
        # adaptive: each request's share of the policy's k, by its drafts' expected acceptance and the measured cost of
        # the compiled shape the step's rows run on (fixed k: every request verifies k)
        self.draft_allocator = (DraftAllocator(self.spec.num_speculative_tokens, step_shape=self._decode_shape)
                                if self.spec and self.spec.adaptive else None)
        self._collected_at: float | None = None  # when the last step was collected
        layout = self.runner.layout
        self.scheduler = DataParallelScheduler(args.scheduler, args.runtime, model.config, num_blocks=layout.num_blocks,
                                               block_size=layout.block_size, ranks=self.runner.ranks,
                                               token_buckets=self.runner.buckets.tokens)
        self.metrics.total_blocks.set(self.scheduler.num_blocks)
        self.requests: dict[str, Request] = {}
        self._out: dict[str, OutputState] = {}
        self._prompt_lp: dict[str, list] = {}
        self._rng = np.random.default_rng(args.runtime.seed)
        self.eos_id = getattr(tokenizer, "eos_id", model.config.eos_token_id)
        self._preemptions_seen = 0
        self._inflight: _InFlight | None = None  # the step dispatched while the previous one's text was made
        self.step_channel = step_channel
        if step_channel is not None:
            self.metrics.add_multiprocess()
        self._async_blocker = async_blocker(args, self.runner, self.eplb is not None)
        self.async_scheduling = self._async_blocker is None
        self._update_gauges()
        self.runner.compiler.gate.busy = self.has_unfinished  # background compiles wait for the steps

    def scheduling_summary(self) -> str:
        """One line for the banner: async scheduling, or why steps go one at a time."""
        if self.async_scheduling and self.spec_policy is not None and self.spec_policy.adaptive:
            return ("async for plain steps (each dispatched before the previous one's tokens reach the host); a step "
                    "verifying drafts goes after the one before it")
        if self.async_scheduling and self.spec is not None:
            return "one step at a time (every step verifies drafts: speculative_config adaptive false)"
        if self.async_scheduling:
            return "async (each step is dispatched before the previous one's tokens reach the host)"
        return f"one step at a time ({self._async_blocker})"

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, *, priority: int = 0,
                    session_id: str | None = None, cache_salt: str | None = None) -> Request:
        """Validate and queue; `ValueError` names what is wrong, `QueueFull` when the queue is full."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt = [int(t) for t in prompt_ids]
        vocab, limit = self.model.config.vocab_size, self.args.runtime.max_model_len
        if not prompt:
            raise ValueError("prompt is empty")
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        if len(prompt) >= limit:
            raise ValueError(f"the prompt has {len(prompt)} tokens; this model's maximum context length is {limit} "
                             f"tokens and at least one must be left to generate")
        max_tokens = limit - len(prompt) if params.max_tokens is None else params.max_tokens
        if len(prompt) + max_tokens > limit:
            raise ValueError(f"this model's maximum context length is {limit} tokens; the request has "
                             f"{len(prompt)} prompt tokens and max_tokens {max_tokens} "
                             f"({len(prompt) + max_tokens} in all)")
        if self.spec and params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs are not served with speculative decoding (--speculative-config)")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        blocks = -(-(len(prompt) + max_tokens) // self.scheduler.block_size)
        if blocks > self.scheduler.blocks_per_rank:
            raise ValueError(f"the request needs up to {blocks} KV blocks; the cache has "
                             f"{self.scheduler.blocks_per_rank}" + (" per data-parallel rank" if self.runner.ranks > 1
                                                                    else ""))
        if params.seed is None and not params.greedy:
            params = dataclasses.replace(params, seed=int(self._rng.integers(2**31)))  # independent streams
        params = dataclasses.replace(params, max_tokens=max_tokens)
        req = Request(request_id, prompt, params, eos_id=self.eos_id, priority=priority, session_id=session_id,
                      cache_salt=cache_salt)
        self.scheduler.add(req)
        self.requests[request_id] = req
        self._out[request_id] = OutputState(req, self.tokenizer)
        self._update_gauges()
        return req

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.scheduler.remove(req)  # the one end the scheduler does not decide
        out = self._ended(req, Finish("abort", None), [], self._out[request_id].flush())
        self._settle()
        self._update_gauges()  # the engine may be idle now: no step would refresh them
        return out

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run the engine one step on: the outputs of one finished step (none when nothing ran). The step after it
        is already dispatched when the text of this one is produced (see the module docstring)."""
        # Trace annotations name the phases of a step (engine.schedule, runner.build / segment1 / segment2 /
        # sample / readback, engine.detokenize) so a profile splits host time by phase (serving.engine.trace_report).
        with jax.profiler.TraceAnnotation("engine.step"):
            if self._inflight is None:  # from idle: the time since the last step is no step's
                self._collected_at = None
            done = self._inflight or self._launch(k=self._next_k())
            self._inflight = None
            outputs: list[RequestOutput] = []
            if done is not None:
                k = self._next_k()
                if self.async_scheduling and k == 0 == done.k:  # the next goes out first, its rows reading done's
                    nxt = self._launch(done)
                    out, before, finishes, now = self._collect(done)
                else:  # a speculative step reads the drafts of the step before it
                    out, before, finishes, now = self._collect(done)
                    nxt = self._launch(k=k)
                self._inflight = nxt  # the device runs it while the host makes this step's text
                outputs = self._outputs(done.sched, out, before, finishes, now)
            self._settle()
            self._update_gauges()
            return outputs

    def _settle(self) -> None:
        """With no request left, wait for the step in flight (its rows belong to ended requests) and drop it, so an
        idle engine holds no device work."""
        if self._inflight is not None and not self.requests:
            self._collect(self._inflight)
            self._inflight = None

    def _next_k(self) -> int:
        """The drafts the next step verifies per request at most (the speculation policy's choice; 0 without)."""
        if self.spec_policy is None:
            return 0
        k = self.spec_policy.choose(len(self.scheduler.running))
        self.metrics.spec_chosen_k.set(k)
        return k

    def _drafts_per_request(self, k: int) -> int | dict[str, int]:
        """The drafts each running request verifies at most in a step of the policy's `k`: the allocator's split by
        the requests' acceptance (`serving.engine.draft_allocation`), or k for all."""
        if not k or self.draft_allocator is None:
            return k
        running = self.scheduler.running
        for req in running:
            if req.acceptance is None:
                req.acceptance = self.draft_allocator.new_request()
        counts = self.draft_allocator.allocate(
            [RequestDrafts(r.acceptance, len(r.draft_ids), r.draft_confidence if r.params.greedy else None)
             for r in running], k, len(running))
        return {r.request_id: n for r, n in zip(running, counts)}

    def _decode_shape(self, rows: int) -> tuple[int, int]:
        """The token and kept-row buckets a decode step of `rows` rows runs on (its busiest data-parallel rank's)."""
        b = self.runner.buckets
        per_rank = min(-(-rows // self.runner.ranks), b.tokens[-1])
        return b.token_bucket(per_rank), b.kept_bucket(per_rank)

    def _launch(self, prev: _InFlight | None = None, k: int = 0) -> _InFlight | None:
        """Schedule and dispatch a step verifying up to `k` drafts per request (0: a plain step); `prev`, the step in
        flight (async scheduling), holds the tokens that its requests' rows in this one read on the device."""
        with jax.profiler.TraceAnnotation("engine.schedule"):
            sched = self.scheduler.schedule(max_drafts=self._drafts_per_request(k))
        if not sched:
            return None
        self._note_admissions(sched)
        rows = {} if prev is None else {id(s.request): int(r) for s, r in zip(prev.sched, prev.launched.segments.rows)}
        chunks, before = [self._chunk(s, rows) for s in sched], None if prev is None else prev.launched
        host = self.runner.plan(chunks, [s.request.params for s in sched], [self._banned(s.request) for s in sched],
                                prev=before, speculate=k > 0)
        if self.step_channel is not None:  # the other processes' ranks run the same step
            self.metrics.step_broadcast(*self.step_channel.publish(Execute(host, reads_prev=before is not None)))
        launched = self.runner.execute(host, before, chunks)
        if self.spec:
            self.metrics.spec_steps[k].inc()
        decode = all(s.sample and s.end - s.start - s.num_draft == 1 for s in sched)  # no prefill chunk
        return _InFlight(sched, launched, self.scheduler.launched(sched) if self.async_scheduling and not k else None,
                         k, decode)

    def _collect(self, step: _InFlight) -> tuple[StepOutput | SpeculativeStepOutput, list[int], list[Finish | None],
                                                  float]:
        """Wait for a step and do what the next one's scheduling needs: the scheduler's postprocess (tokens
        appended, finishes decided, finished requests freed), given the stop strings found in the text of requests
        that have them, and the next drafts. A request that ended while the step ran (with async scheduling: in the
        previous step; or aborted) is skipped: its row is dropped. Returns the step's outputs, each request's token
        count before the step and its finish."""
        out = self.runner.collect(step.launched)
        collected, last = time.perf_counter(), self._collected_at
        self._collected_at = collected
        if self.eplb is not None and (placement := self.eplb.after_step(out.expert_counts)) is not None:
            if self.step_channel is not None:  # the other processes migrate theirs at the same place
                self.step_channel.publish(Rebalance(placement))
            self.eplb.apply(placement, self.runner)  # the weights migrate here, between two steps
        now = time.monotonic()
        before, finishes, emitted = [], [], 0
        for i, s in enumerate(step.sched):
            req = s.request
            before.append(req.num_tokens)
            finishes.append(None)
            if req.finished:
                continue
            toks = self._emitted(s, out, i)
            emitted += len(toks)
            stop = self._out[req.request_id].find_stop(toks) if toks and req.params.stop else None
            finishes[-1] = self.scheduler.postprocess(s, toks, None if step.pending is None else step.pending[i],
                                                      stop)
        if self.spec_policy is not None and step.decode and last is not None:
            drafts = sum(s.num_draft for s in step.sched)
            self.spec_policy.record(step.k, len(step.sched), emitted, collected - last, verified=drafts > 0)
            relative = self.spec_policy.relative(len(step.sched), collected - last)
            if self.draft_allocator is not None and step.k and relative is not None:
                self.draft_allocator.record(len(step.sched), drafts, relative)
        return out, before, finishes, now

    def _outputs(self, sched: list[Scheduled], out: StepOutput | SpeculativeStepOutput, before: list[int],
                 finishes: list[Finish | None], now: float) -> list[RequestOutput]:
        """A collected step's per-request deltas: text, logprobs, finishes."""
        outputs = []
        # the per-request text work is counted here, not worth an annotation per request
        with jax.profiler.TraceAnnotation("engine.detokenize"):
            for i, s in enumerate(sched):
                req = s.request
                if self.requests.get(req.request_id) is not req:  # ended before this step was collected
                    continue
                if i in out.prompt_logprobs:
                    self._collect_prompt_logprobs(s, out.prompt_logprobs[i])
                if s.sample:
                    outputs.append(self._sampled(req, req.token_ids[before[i]:], finishes[i], out, i, now))
        return outputs

    def _emitted(self, s: Scheduled, out: StepOutput | SpeculativeStepOutput, i: int) -> list[int]:
        """The chunk's new tokens (none unless it sampled); with speculative decoding, counts the acceptance and
        keeps the request's next drafts."""
        if not s.sample:
            return []
        toks = [int(t) for t in out.emitted(i)]
        if isinstance(out, SpeculativeStepOutput):
            m = self.metrics
            m.spec_request_drafts[s.num_draft].inc()
            if s.num_draft:
                if s.request.acceptance is not None:
                    self.draft_allocator.observe(s.request.acceptance, s.num_draft, len(toks) - 1)
                m.spec_drafts.inc()
                m.spec_draft_tokens.inc(s.num_draft)
                m.spec_accepted.inc(len(toks) - 1)
                if s.request.params.greedy:
                    m.spec_confidence(s.request.draft_confidence, s.num_draft, len(toks) - 1)
                for pos in range(len(toks) - 1):
                    m.spec_accepted_per_pos[pos].inc()
            s.request.draft_ids = [int(t) for t in out.drafts[i][:self.spec.num_speculative_tokens]]
            s.request.draft_confidence = [float(c) for c in out.draft_confidence[i][:self.spec.num_speculative_tokens]]
        else:
            s.request.draft_ids, s.request.draft_confidence = [], []  # a plain step moved past their positions
        return toks

    @staticmethod
    def _logprobs(out: StepOutput | SpeculativeStepOutput, i: int, toks: list[int], k: int) -> list[TokenLogprob]:
        """The logprobs of the chunk's appended tokens (the first `len(toks)` it emitted), `k` top ones each."""
        rows = out.emitted_logprobs(i)
        return [TokenLogprob(t, float(rows.logprob[j]), _top(rows.top_ids[j], rows.top_logprobs[j], k))
                for j, t in enumerate(toks)]

    def _chunk(self, s: Scheduled, prev_rows: dict[int, int]) -> SeqChunk:
        """`prev_rows`: each request's sampled-token row in the step in flight (async scheduling)."""
        req = s.request
        return SeqChunk(slot=req.slot, block_table=self.scheduler.block_table(req), token_ids=req.token_ids,
                        pending_row=prev_rows[id(req)] if req.num_pending else -1,
                        draft_ids=req.draft_ids[:s.num_draft],
                        ban_rows=max(0, req.params.min_tokens - req.num_output),
                        rank=req.rank, start=s.start, end=s.end, kv_floor=req.plan.replay_start,
                        write_floor=req.plan.write_floor,
                        trim=self.args.runtime.swa_bounded_replay and not req.keeps_all_rows, sample=s.sample,
                        prompt_logprobs=req.keeps_all_rows and req.request_id in self._prompt_lp
                        and s.start < req.num_prompt - 1)

    def _banned(self, req: Request) -> list[int]:
        """EOS and stop ids cannot be sampled before `min_tokens` outputs (vLLM masks them the same way)."""
        p = req.params
        if req.num_output + req.num_pending >= p.min_tokens:
            return []
        return ([] if req.eos_id is None else [req.eos_id]) + list(p.stop_token_ids)

    def _note_admissions(self, sched: list[Scheduled]) -> None:
        for s in sched:
            req = s.request
            if not req.admitted:  # first admission: count the prefix-cache lookup once per request
                req.admitted = True
                self.metrics.prefix_queries.inc(req.num_prompt)
                self.metrics.prefix_hits.inc(req.cached_tokens)
                self.metrics.prompt_tokens.inc(req.num_prompt)
                if req.keeps_all_rows:
                    self._prompt_lp[req.request_id] = [None] * req.num_prompt

    def _collect_prompt_logprobs(self, s: Scheduled, rows) -> None:
        req = s.request
        got = self._prompt_lp.get(req.request_id)
        if got is None:
            return
        k = req.params.prompt_logprobs
        for j, p in enumerate(range(s.start, min(s.end, req.num_prompt - 1))):
            tok = req.prompt_ids[p + 1]
            got[p + 1] = TokenLogprob(tok, float(rows.logprob[j]), _top(rows.top_ids[j], rows.top_logprobs[j], k))

    def _sampled(self, req: Request, toks: list[int], finish: Finish | None,
                 out: StepOutput | SpeculativeStepOutput, i: int, now: float) -> RequestOutput:
        """The scheduler appended `toks` (one, or with speculative decoding up to 1 + k, cut after the first that
        finishes the request) and decided `finish` at the last: their text and logprobs."""
        if req.first_token_time is None:
            req.first_token_time = now
            self.metrics.ttft.observe(now - req.arrival)
        else:
            self.metrics.itl.observe(now - req.last_token_time)
        req.last_token_time = now
        state = self._out[req.request_id]
        text = "".join(state.update(tok, finish if j == len(toks) - 1 else None) for j, tok in enumerate(toks))
        self.metrics.generation_tokens.inc(len(toks))
        lp = None if req.params.logprobs is None else self._logprobs(out, i, toks, req.params.logprobs)
        prompt_lp = self._prompt_lp.pop(req.request_id, None)
        if finish is not None:
            return self._ended(req, finish, toks, text, new_logprobs=lp, prompt_logprobs=prompt_lp)
        return RequestOutput(req.request_id, toks, text, False, new_logprobs=lp, prompt_logprobs=prompt_lp,
                             **self._counts(req))

    def _ended(self, req: Request, finish: Finish, new_ids: list[int], text: str, **extra) -> RequestOutput:
        """The engine's side of a request that ended (the scheduler has freed it): forget it, count it, and its
        last output."""
        del self.requests[req.request_id]
        del self._out[req.request_id]
        self._prompt_lp.pop(req.request_id, None)
        req.finish_reason, req.stop_reason = finish
        self.metrics.e2e.observe(time.monotonic() - req.arrival)
        self.metrics.finished(finish.reason)
        log.info("finished %s session=%s rank=%s reason=%s prompt=%d cached=%d output=%d preemptions=%d",
                 req.request_id, req.session_id, req.rank, finish.reason, req.num_prompt, req.cached_tokens,
                 req.num_output, req.num_preemptions)
        return RequestOutput(req.request_id, new_ids, text, True, finish.reason, finish.stop_reason, **extra,
                             **self._counts(req))

    @staticmethod
    def _counts(req: Request) -> dict:
        return {"num_prompt_tokens": req.num_prompt, "num_cached_tokens": req.cached_tokens,
                "num_output_tokens": req.num_output}

    def _update_gauges(self) -> None:
        m, sch = self.metrics, self.scheduler
        m.running.set(len(sch.running))
        m.waiting.set(sch.num_waiting)
        m.kv_usage.set(sch.usage)
        m.free_blocks.set(sch.num_free_blocks)
        for rank, n in enumerate(sch.rank_requests()):
            m.rank_requests(rank).set(n)
        m.preemptions.inc(sch.num_preemptions - self._preemptions_seen)
        self._preemptions_seen = sch.num_preemptions


def async_blocker(args: EngineArgs, runner: Runner, eplb: bool) -> str | None:
    """Why the engine schedules one step at a time (the flag, the runner, EPLB's weight moves between steps); None
    when it schedules each step before the previous one's tokens are read."""
    if not args.scheduler.async_scheduling:
        return "--no-async-scheduling"
    return runner.async_blocker or ("EPLB" if eplb else None)


def _top(ids: np.ndarray, lps: np.ndarray, k: int) -> tuple[tuple[int, float], ...]:
    return tuple((int(a), float(b)) for a, b in zip(ids[:k], lps[:k]))
