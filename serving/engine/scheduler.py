"""Decides what each step computes: continuous batching under a token budget (vLLM v1's shape).

No prefill/decode phases: every request has `num_computed` chasing `num_tokens`. Each step first serves the
running requests in admission order (a decode row, or the next chunk of a prefill), preempting from the back
when blocks run out (recompute: blocks and slot freed, the request waits again at the front and re-looks-up
the prefix cache when it resumes); then admits waiting requests while slots, budget and blocks allow.
Admission looks up the prefix cache and applies the encoder-replay rewind (`plan_prefix_hit`): the request
restarts at `replay_start`, never rewriting cached rows below `write_floor`. Blocks for the whole prompt are
reserved at admission so chunked prefills of many long prompts cannot thrash each other. After the step,
`postprocess` appends the sampled tokens, decides the finishes (EOS, stop token ids, length, and the stop strings
the text handling found in the step's text) and frees what a finished request holds (nano-vllm's `postprocess`).

Bucket fit (`_fit_to_bucket`, off unless `bucket_fit_min_tokens` is set): the runner pads a step's rows up to the
next compiled token bucket, and in a compute-bound step a padded row costs what a real one does. So a large step
that spills over a bucket only by prefill tokens is cut back to that bucket; the cut tokens lead the next step. Off
by default: on the peer V4 checkpoint a fit shortened a wave's longest step in-process, but served runs alternated
with it off measured no TTFT gain and a slightly longer TPOT (docs/design/measurements.md).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from dsv41.config import ModelConfig
from serving.engine.dp_router import POLICIES as ROUTING_POLICIES
from serving.engine.request import Finish, Request, Status, StopString
from serving.runtime.block_manager import BlockManager, PrefixHit
from serving.runtime.config import RuntimeConfig
from serving.runtime.encoder_replay import plan_prefix_hit


SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    """How the scheduler chooses; what it fills - slots, token budget, model length - is the runtime's
    (`RuntimeConfig`), which the scheduler is given too. Each field is also a server flag."""

    long_prefill_token_threshold: int = field(default=0, metadata={
        "help": "cap on one request's prefill tokens per step while others run or wait (0: off)"})
    bucket_fit_min_tokens: int = field(default=0, metadata={
        "help": "a step that spills over a compiled token bucket of at least this many tokens only by prefill tokens "
                "is cut back to that bucket instead of padding to the next one (the cut tokens lead the next step); "
                "0: off"})
    max_queued_requests: int = field(default=4096, metadata={
        "help": "waiting requests beyond this are refused (HTTP 503)"})
    scheduling_policy: str = field(default="fcfs", metadata={
        "choices": SCHEDULING_POLICIES, "help": "fcfs, or priority (a request's lower priority value first, then "
                                                "arrival; preemption takes the highest value)"})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "reuse the KV of cached full-block prompt prefixes"})
    async_scheduling: bool = field(default=True, metadata={
        "help": "schedule and dispatch each step before the previous one's tokens reach the host (its decode rows "
                "read them on the device), so the host's work between steps overlaps the device's; not with Engram "
                "tables in host memory or EPLB (steps are scheduled one at a time there), and with speculative "
                "decoding for its plain steps (k = 0)"})
    dp_routing_policy: str = field(default="sticky", metadata={
        "choices": ROUTING_POLICIES, "help": "data-parallel ranks: keep a session (X-Session-ID, else its prompt's "
                                             "first tokens) on the rank holding its prefix cache unless saturated "
                                             "(sticky), or always the least-loaded rank (load)"})
    dp_max_inflight: int | None = field(default=None, metadata={
        "help": "requests in flight (running or waiting) that saturate a data-parallel rank for sticky routing "
                "(default: 2 x max-num-seqs)"})

    def __post_init__(self):
        for name, allowed in (("scheduling_policy", SCHEDULING_POLICIES), ("dp_routing_policy", ROUTING_POLICIES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("long_prefill_token_threshold", "bucket_fit_min_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        if self.dp_max_inflight is not None and self.dp_max_inflight < 1:
            raise ValueError(f"dp_max_inflight must be >= 1, got {self.dp_max_inflight}")


@dataclass(frozen=True)
class Scheduled:
    """One request's work in a step: positions [start, end); `sample` when end reaches its last token (fixed when
    scheduled: `postprocess` appends the sampled token afterwards). Speculative decoding: the last `num_draft`
    positions hold the request's drafts (`Request.draft_ids`), verified in this step."""

    request: Request
    start: int
    end: int
    num_draft: int = 0
    sample: bool = field(init=False)

    def __post_init__(self):
        req = self.request
        object.__setattr__(self, "sample", self.end - self.num_draft == req.num_tokens + req.num_pending)

    @property
    def cuttable(self) -> bool:
        """Prompt (or recomputed) tokens the bucket fit may defer: neither a lone decode row nor drafts."""
        return not self.num_draft and not (self.sample and self.end - self.start == 1)


class QueueFull(RuntimeError):
    """The waiting queue is at `max_queued_requests`."""


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, rc: RuntimeConfig, model_config: ModelConfig, blocks: BlockManager,
                 token_buckets: Sequence[int] = ()):
        """`rc`: the capacities the runtime was built for (slots, token budget, model length, replay mode).
        `token_buckets`: the runner's compiled step sizes, for the bucket fit (none: no fit)."""
        self.cfg, self.rc, self.model_config, self.blocks = cfg, rc, model_config, blocks
        self.token_buckets = tuple(sorted(token_buckets))
        self.by_priority = cfg.scheduling_policy == "priority"
        self.running: list[Request] = []  # admission order: preemption takes from the back
        self._waiting_fcfs: deque[Request] = deque()
        self._waiting_heap: list[tuple[int, float, int, Request]] = []
        self._tie = itertools.count()
        self.free_slots = list(range(rc.max_num_seqs))
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queue
    @property
    def num_waiting(self) -> int:
        return len(self._waiting_fcfs) + len(self._waiting_heap)

    def add(self, req: Request, *, front: bool = False) -> None:
        if not front and self.num_waiting >= self.cfg.max_queued_requests:
            raise QueueFull(f"the waiting queue is full ({self.cfg.max_queued_requests} requests)")
        req.status = Status.WAITING
        if self.by_priority:
            heapq.heappush(self._waiting_heap, (req.priority, req.arrival, next(self._tie), req))
        elif front:
            self._waiting_fcfs.appendleft(req)
        else:
            self._waiting_fcfs.append(req)

    @property
    def next_waiting(self) -> Request | None:
        """The waiting request admission tries next (FCFS: the oldest, preempted ones first; priority: the
        lowest value, then the earliest arrival), or None."""
        if self.by_priority:
            return self._waiting_heap[0][3] if self._waiting_heap else None
        return self._waiting_fcfs[0] if self._waiting_fcfs else None

    def _pop(self) -> Request:
        return heapq.heappop(self._waiting_heap)[3] if self.by_priority else self._waiting_fcfs.popleft()

    def remove(self, req: Request) -> None:
        """Take a request out wherever it is and free its blocks and slot (an abort, or a finish `postprocess`
        decided); a finished one stays so."""
        if req in self.running:
            self.running.remove(req)
            self._release(req)
        elif req.status is Status.WAITING:
            if self.by_priority:
                self._waiting_heap = [e for e in self._waiting_heap if e[3] is not req]
                heapq.heapify(self._waiting_heap)
            elif req in self._waiting_fcfs:
                self._waiting_fcfs.remove(req)
        req.status = Status.FINISHED

    def _release(self, req: Request) -> None:
        self.blocks.free(req.request_id)
        self.free_slots.append(req.slot)
        req.slot = None

    # --------------------------------------------------------------- schedule
    def schedule(self, max_drafts: int | Mapping[str, int] | None = None) -> list[Scheduled]:
        """The next step's chunks; each decoding request verifies at most `max_drafts` of its drafts (None: all; a
        mapping: by request id, 0 for a request it does not name)."""
        budget = self.rc.max_num_batched_tokens
        out: list[Scheduled] = []
        preempted = False
        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            n = self._chunk(req, req.num_computed, budget)
            if n == 0:  # async scheduling: its last token is in flight and ends it (a length limit)
                continue
            most = max_drafts.get(req.request_id, 0) if isinstance(max_drafts, Mapping) else max_drafts
            k = self._drafts(req, budget - n, most) if req.num_computed + n == req.num_tokens else 0
            if k and not self.blocks.allocate(req.request_id, req.num_computed + n + k):
                k = 0  # short of blocks: verify nothing rather than preempt for drafts
            while not self.blocks.allocate(req.request_id, req.num_computed + n):
                victim = self._victim(exclude=[s.request for s in out])
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                out.append(Scheduled(req, req.num_computed, req.num_computed + n + k, k))
                budget -= n + k
        # vLLM admits nothing new in a step that had to preempt: the pool is known to be short.
        admitted = []
        while not preempted and budget > 0 and self.free_slots and self.next_waiting is not None:
            req = self.next_waiting
            start = self._admit(req)
            if start is None:
                break
            self._pop()
            n = self._chunk(req, start, budget)
            out.append(Scheduled(req, start, start + n))
            admitted.append(req)
            budget -= n
        return self._fit_to_bucket(out, admitted)

    def _fit_to_bucket(self, out: list[Scheduled], admitted: list[Request]) -> list[Scheduled]:
        """Cuts a step of T tokens back to the largest bucket b <= T when b >= `bucket_fit_min_tokens`, taking the T - b
        tokens from the newest prefill chunks (a decode row or a draft is never cut): a step just past a bucket, padded
        to the next, runs the padding at full cost; cut back, it runs shorter and the cut prompts lead the next step
        (docs/design/measurements.md). A chunk cut to nothing waits: a request admitted in this step goes back to the
        front of the queue as if never admitted (no preemption counted). A step of decode rows is never cut."""
        total = sum(s.end - s.start for s in out)
        low = max((b for b in self.token_buckets if b <= total), default=0)
        spill = total - low
        if (not self.cfg.bucket_fit_min_tokens or low < self.cfg.bucket_fit_min_tokens or spill == 0
                or sum(s.end - s.start for s in out if s.cuttable) < spill):
            return out
        for i in reversed(range(len(out))):
            s, n = out[i], out[i].end - out[i].start
            if not s.cuttable or spill == 0:
                continue
            cut = min(spill, n)
            spill -= cut
            if cut < n:
                out[i] = Scheduled(s.request, s.start, s.end - cut)
                continue
            del out[i]
            if s.request in admitted:
                self._unadmit(s.request)
        return out

    def _chunk(self, req: Request, start: int, budget: int) -> int:
        n = min(req.num_tokens + req.num_pending - start, budget)
        cap = self.cfg.long_prefill_token_threshold
        if cap and n > 1 and (len(self.running) > 1 or self.num_waiting):  # no cap for a lone request
            n = min(n, cap)
        return n

    def _drafts(self, req: Request, room: int, most: int | None = None) -> int:
        """Drafts a decoding request verifies: what it has, within the step's token budget, the tokens it may still
        emit (a step emits up to one more than it verifies) and the model length. While min_tokens bans EOS and
        the stop ids, the verification bans them in the rows that emit those outputs (`SeqChunk.ban_rows`)."""
        p = req.params
        if not req.draft_ids:
            return 0
        left = (p.max_tokens - req.num_output) if p.max_tokens is not None else self.rc.max_model_len
        most = len(req.draft_ids) if most is None else min(most, len(req.draft_ids))
        return max(0, min(most, room, left - 1, self.rc.max_model_len - req.num_tokens))

    def _admit(self, req: Request) -> int | None:
        """Prefix lookup + replay rewind + block reservation for the whole sequence; the first position to
        compute, or None (nothing changed) when the blocks are not there."""
        bm = self.blocks
        hit = PrefixHit(0, ())
        if self.cfg.enable_prefix_caching and not req.keeps_all_rows:
            hit = bm.lookup(req.token_ids[:-1], req.cache_key)  # at least one token is computed: its logits
        plan = plan_prefix_hit(hit.num_tokens, self.model_config, self.rc.swa_bounded_replay)
        if plan.hit_tokens < hit.num_tokens:
            hit = PrefixHit(plan.hit_tokens, hit.block_ids[: plan.hit_tokens // bm.block_size])
        bm.admit(req.request_id, req.token_ids, hit, req.cache_key)
        if not bm.allocate(req.request_id, req.num_tokens):
            bm.free(req.request_id)
            return None
        req.slot = self.free_slots.pop(0)
        req.plan, req.num_computed, req.status = plan, plan.replay_start, Status.RUNNING
        if req.num_preemptions == 0:
            req.cached_tokens = plan.hit_tokens
        self.running.append(req)
        return plan.replay_start

    def _victim(self, exclude: list[Request]) -> Request:
        """The request to preempt: the last admitted (FCFS) or the lowest priority, latest arrival."""
        cands = [r for r in self.running if r not in exclude] or self.running
        if self.by_priority:
            return max(cands, key=lambda r: (r.priority, r.arrival))
        return cands[-1]

    def _unadmit(self, req: Request) -> None:
        """Back to the front of the queue, its blocks and slot freed: it starts again from the prefix lookup."""
        self.running.remove(req)
        self._release(req)
        req.num_computed, req.plan, req.draft_ids, req.draft_confidence = 0, None, [], []
        self.add(req, front=True)

    def _preempt(self, req: Request) -> None:
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._unadmit(req)

    # ----------------------------------------------------------------- update
    def launched(self, sched: list[Scheduled]) -> list[bool]:
        """Async scheduling: the step is dispatched and the next one is scheduled before its tokens are known. Its
        positions count as computed now, and each sampling request gets one pending token (the next step's row for
        it reads that token on the device) unless the token ends it by a length limit. Returns, per chunk, whether
        a pending token was added (`postprocess` takes it back)."""
        added = []
        for s in sched:
            req = s.request
            req.num_computed = s.end
            n_out, n_tok = req.num_output + req.num_pending + 1, req.num_tokens + req.num_pending + 1
            p = req.params
            more = s.sample and not ((p.max_tokens is not None and n_out >= p.max_tokens)
                                     or n_tok >= self.rc.max_model_len)
            req.num_pending += more
            added.append(more)
        return added

    def postprocess(self, s: Scheduled, tokens: int | list[int] | None, pending: bool | None = None,
                    stop: StopString | None = None) -> Finish | None:
        """The step ran `s`: positions [start, end) are written - with drafts, only up to the last accepted one
        stays (the rest was rolled back) - and their full blocks are registered in the prefix cache; when the
        chunk sampled, its emitted tokens (one, or the accepted drafts and the bonus token) are appended, up to
        the first that finishes the request, whose blocks and slot are then freed. Returns that finish, if any:
        EOS (unless ignore_eos) or a stop token id once more than `min_tokens` are out, else `stop` (the stop
        string the text handling found, ending at one of these tokens), else the length limits (`max_tokens`,
        `max_model_len`). `pending` (async scheduling): whether `launched` gave the chunk a pending token, which
        the appended one replaces."""
        req = s.request
        toks = [] if tokens is None else [tokens] if isinstance(tokens, int) else list(tokens)
        written = s.end - s.num_draft + max(len(toks) - 1, 0)  # the rows of accepted tokens
        if pending is None:
            req.num_computed = written
        else:  # async scheduling: `launched` counted the step's rows, and maybe a pending token, when it went out
            req.num_pending -= pending
        finish = self._append(req, toks, stop) if s.sample else None
        if req.status is Status.RUNNING:  # not preempted while the step ran (its blocks are gone then)
            self.blocks.commit(req.request_id, req.token_ids, min(written, req.num_tokens))
        if finish is not None:
            self.remove(req)
        return finish

    def _append(self, req: Request, toks: list[int], stop: StopString | None) -> Finish | None:
        p = req.params
        for j, token in enumerate(toks):
            req.token_ids.append(token)
            if req.num_output > p.min_tokens:
                if token in p.stop_token_ids:
                    return Finish("stop", token)
                if token == req.eos_id and not p.ignore_eos:
                    return Finish("stop", None)
            if stop is not None and stop.index == j:
                return Finish("stop", stop.text)
            if (p.max_tokens is not None and req.num_output >= p.max_tokens) or req.num_tokens >= self.rc.max_model_len:
                return Finish("length", None)
        return None
