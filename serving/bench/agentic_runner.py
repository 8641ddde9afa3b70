"""One point of the agentic benchmark: closed-loop lanes of session trees against an OpenAI-compatible server.

Load model (AgentX's, spec §7.1): `concurrency` lanes; a lane runs one session tree at a time
(`agentic_workload.py`) and starts the next when every conversation of the current one has finished.
Subagents run inside their parent's lane as concurrent tasks, as AgentX runs them, so requests in flight
can exceed the lane count; a gating subagent holds its parent's next turn back, a background one does not.
Think time is slept end-to-start; a turn waits for max(previous end + think time, its gating subagents).
Every request carries `X-Session-ID` = its tree's id, so a sticky router keeps a tree (subagents too) on
the rank that holds its prefix.

Trees come from one counter, so tree k is the same whatever the concurrency. Warm-up (AgentX's t*): a
lane's first tree starts at its `warm_start_turn`; root turn warm_start_turn - 1 of every lane is sent
first, all lanes together, and left out of the metrics (it fills the prefix cache as the agent's history
would have); then the profile starts. Stop: `duration_s` (no request is sent after it; requests in flight
finish and count) and/or `num_sessions` (trees started).

Mirror / lag (`mirror_ranks` D >= 2, the seeds' data-parallel experiment): each of the `concurrency` lane
groups is D copies of the same trees, copy r under session id `<tree id>.rank<r>`. Before anything else
every copy's id is pinned to its rank: per tree, D short requests are sent one after another, each once the
previous one is in flight (/metrics' `dsv41:dp_rank_requests` counts it), so the router (least-loaded on a
key's first sight, ties to the lowest rank) places copy r on rank r, and a sticky router keeps it there; the
same gauge then confirms one request per rank. (Our router gives a new key no fixed rank - no hash of the
session id - so ids cannot be chosen to land on a rank; pinning is how "the same work on every rank" is
made.) Mirror (`mirror_lag_s` 0): all copies start together, so every rank runs the same work at the same
moment. Lag: copy r starts r * mirror_lag_s later.
The comparable number is `window_token_throughput`: tokens of requests that ended while every copy was
running (from the last copy's start to the first copy's last response), per second. The theoretical hit
rate is counted per copy (each rank has its own cache).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import re
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Iterator

import httpx
import numpy as np

from serving.bench import metrics, serve
from serving.bench.agentic_workload import AgenticConfig, Conversation, SessionTree, block_reuse, session_tree
from serving.bench.metrics import RequestRecord
from serving.bench.workloads import Turn

_RANK_GAUGE = re.compile(r'^dsv41:dp_rank_requests\{[^}]*rank="(\d+)"[^}]*\}\s+([0-9.eE+-]+)', re.M)


@dataclass
class PointSpec:
    """What one benchmark point runs (the workload config says what the trees look like)."""

    concurrency: int
    seed: int = 0
    salt: int = 0  # cache-bust salt: points on one server share no tree prefix
    duration_s: float | None = None
    num_sessions: int | None = None
    mirror_ranks: int = 0  # >= 2: mirror / lag copies, one per data-parallel rank
    mirror_lag_s: float = 0.0
    endpoint: str = "completions"
    temperature: float = 0.0
    percentiles: tuple[float, ...] = (50.0, 90.0, 99.0)
    request_timeout_s: float = 600.0

    def __post_init__(self):
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.duration_s is None and self.num_sessions is None:
            raise ValueError("give a duration (--duration-s) or a number of session trees (--num-sessions)")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if self.num_sessions is not None and self.num_sessions < 1:
            raise ValueError(f"num_sessions must be >= 1, got {self.num_sessions}")
        if self.mirror_ranks == 1 or self.mirror_ranks < 0:
            raise ValueError(f"mirror_ranks must be 0 (off) or >= 2, got {self.mirror_ranks}")
        if self.mirror_ranks and self.num_sessions is None:
            raise ValueError("mirror / lag runs need --num-sessions: every copy runs the same fixed trees")
        if self.mirror_lag_s < 0:
            raise ValueError(f"mirror_lag_s must be >= 0, got {self.mirror_lag_s}")
        if self.endpoint not in serve.ENDPOINTS:
            raise ValueError(f"endpoint must be one of {sorted(serve.ENDPOINTS)}, got {self.endpoint!r}")


@dataclass
class Sent:
    """One request as sent: its record, its prompt, and where it belongs."""

    record: RequestRecord
    turn: Turn
    cache_domain: int = 0  # the mirror copy (= rank) whose cache it meets; 0 without mirror
    warmup: bool = False
    subagent: bool = False


@dataclass
class _Lane:
    first: SessionTree
    next_trees: Iterator[int]
    copy: int = 0  # mirror copy / rank
    delay_s: float = 0.0


@dataclass
class _State:
    sent: list[Sent] = field(default_factory=list)
    deadline: float | None = None
    in_flight: int = 0
    max_in_flight: int = 0
    trees_started: int = 0
    trees_finished: int = 0


class PointRunner:
    def __init__(self, client: httpx.AsyncClient, base_url: str, model: str, config: AgenticConfig, spec: PointSpec,
                 api_key: str | None = None):
        self.client, self.model, self.config, self.spec = client, model, config, spec
        self.root = base_url.rstrip("/").removesuffix("/v1")
        self.url = self.root + serve.ENDPOINTS[spec.endpoint]
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.body_args = SimpleNamespace(endpoint=spec.endpoint, temperature=spec.temperature, ignore_eos=True)
        self.state = _State()
        self.pins: list[bool | None] = []  # per mirrored tree: its copies seen one per rank (None: no gauge)
        self.profile_start = 0.0
        self.copy_ends: dict[int, float] = {}  # mirror copy -> its last measured response end

    def tree(self, index: int) -> SessionTree:
        return session_tree(self.config, self.spec.seed, index, self.spec.salt)

    def over(self) -> bool:
        return self.state.deadline is not None and time.perf_counter() >= self.state.deadline

    async def request(self, conv: Conversation, t: int, session_header: str, copy: int, *, warmup: bool = False,
                      subagent: bool = False) -> RequestRecord | None:
        if not warmup and self.over():
            return None
        turn = conv.turns[t]
        rec = RequestRecord(send_time=0.0, end_time=0.0, prompt_tokens=turn.prompt_len,
                            session_id=conv.conversation_id, turn=t)
        st = self.state
        st.sent.append(Sent(rec, turn, copy, warmup, subagent))
        st.in_flight += 1
        st.max_in_flight = max(st.max_in_flight, st.in_flight)
        try:
            await serve.send_request(self.client, self.url, {**self.headers, "X-Session-ID": session_header},
                                     serve.request_body(self.body_args, self.model, turn), rec)
        finally:
            st.in_flight -= 1
        return rec

    async def conversation(self, conv: Conversation, session_header: str, copy: int, start_turn: int = 0,
                           subagent: bool = False) -> bool:
        """Run turns from `start_turn` with their subagents; True when every turn was sent."""
        gates: list[asyncio.Task] = []
        background: list[asyncio.Task] = []
        prev_end, complete = None, True
        for t in range(start_turn, len(conv.turns)):
            if gates:  # subagents spawned after turn t - 1 that gate turn t
                complete &= all(await asyncio.gather(*gates))
                gates = []
            if prev_end is not None and (wait := prev_end + conv.think_s[t] - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
            rec = await self.request(conv, t, session_header, copy, subagent=subagent)
            if rec is None:
                complete = False
                break
            prev_end = rec.end_time
            for s in conv.subagents:
                if s.after_turn == t:
                    task = asyncio.create_task(self.conversation(s.conversation, session_header, copy, 0, True))
                    (gates if s.gating else background).append(task)
        done = await asyncio.gather(*gates, *background)
        return complete and all(done)

    async def lane(self, lane: _Lane) -> None:
        if lane.delay_s:
            await asyncio.sleep(lane.delay_s)
        suffix = f".rank{lane.copy}" if self.spec.mirror_ranks else ""
        tree, start = lane.first, lane.first.warm_start_turn
        while tree is not None and not self.over():
            self.state.trees_started += 1
            if await self.conversation(tree.root, tree.session_id + suffix, lane.copy, start):
                self.state.trees_finished += 1
            start = 0
            k = next(lane.next_trees, None)
            tree = None if k is None else self.tree(k)

    def lanes(self) -> list[_Lane]:
        spec = self.spec
        limit = spec.num_sessions
        groups = spec.concurrency if limit is None else min(spec.concurrency, limit)
        if not spec.mirror_ranks:
            shared = iter(range(groups, limit)) if limit is not None else itertools.count(groups)
            return [_Lane(self.tree(g), shared) for g in range(groups)]
        return [_Lane(self.tree(g), iter(range(g + groups, limit, groups)), r, r * spec.mirror_lag_s)
                for g in range(groups) for r in range(spec.mirror_ranks)]

    async def rank_counts(self) -> dict[int, float] | None:
        """Requests in flight per rank from /metrics' `dsv41:dp_rank_requests` (None: no such gauge)."""
        resp = await self.client.get(self.root + "/metrics", headers=self.headers)
        found = {int(r): float(v) for r, v in _RANK_GAUGE.findall(resp.text)} if resp.status_code == 200 else {}
        return found or None

    async def pin(self, session_id: str, ranks: int, prompt: list[int]) -> bool | None:
        """Put copies `<session_id>.rank<r>` on rank r (see the module docstring): copy r is sent once copy r-1
        is in flight - the per-rank gauge counts it (updated when a request is added), or, on a server without
        the gauge, its first text chunk arrived. True when the gauge then shows one request on every rank,
        None without the gauge."""
        tokens = 4 + 4 * ranks  # every copy is still in flight when the last one is routed
        routed = [asyncio.Event() for _ in range(ranks)]
        first_text = [asyncio.Event() for _ in range(ranks)]
        ended = [asyncio.Event() for _ in range(ranks)]

        async def one(r: int) -> None:
            if r:
                await routed[r - 1].wait()
            body = {"model": self.model, "prompt": prompt, "max_tokens": tokens, "min_tokens": tokens,
                    "ignore_eos": True, "temperature": 0.0, "stream": True}
            headers = {**self.headers, "X-Session-ID": f"{session_id}.rank{r}"}
            try:
                async with self.client.stream("POST", self.root + serve.ENDPOINTS["completions"], json=body,
                                              headers=headers) as resp:
                    if resp.status_code != 200:
                        raise RuntimeError(f"pinning {session_id}.rank{r}: "
                                           f"{serve._error_message(resp.status_code, await resp.aread())}")
                    async for line in resp.aiter_lines():
                        if line.startswith("data:") and '"text"' in line:
                            first_text[r].set()
            finally:
                first_text[r].set()
                ended[r].set()

        async def watch() -> bool | None:
            counts = None
            for r in range(ranks):
                while True:
                    counts = await self.rank_counts()
                    if counts is None:  # no gauge: a byte-level model may hold text back, but it is all we have
                        await first_text[r].wait()
                        break
                    if sum(counts.values()) >= r + 1 or ended[r].is_set():
                        break
                    await asyncio.sleep(0.002)
                routed[r].set()
            return None if counts is None else all(counts.get(r) == 1.0 for r in range(ranks))

        *_, placed = await asyncio.gather(*(one(r) for r in range(ranks)), watch())
        return placed

    async def run(self) -> list[Sent]:
        spec, st = self.spec, self.state
        lanes = self.lanes()
        if spec.mirror_ranks:
            rng = np.random.default_rng([spec.seed, 3, spec.salt])
            lo, hi = self.config.token_id_range
            for k in range(spec.num_sessions):
                prompt = [int(x) for x in rng.integers(lo, hi, size=self.config.block_size)]
                self.pins.append(await self.pin(self.tree(k).session_id, spec.mirror_ranks, prompt))
        suffix = (lambda r: f".rank{r}") if spec.mirror_ranks else (lambda r: "")
        await asyncio.gather(*(self.request(ln.first.root, ln.first.warm_start_turn - 1,
                                            ln.first.session_id + suffix(ln.copy), ln.copy, warmup=True)
                               for ln in lanes if ln.first.warm_start_turn >= 1))
        self.profile_start = time.perf_counter()
        if spec.duration_s is not None:
            st.deadline = self.profile_start + spec.duration_s
        await asyncio.gather(*(self.lane(ln) for ln in lanes))
        for s in st.sent:
            if not s.warmup:
                self.copy_ends[s.cache_domain] = max(self.copy_ends.get(s.cache_domain, 0.0), s.record.end_time)
        return st.sent


def theoretical_reuse(sent: list[Sent], block_size: int) -> tuple[int, int]:
    """(tokens an ideal prefix cache per copy serves, tokens sent) over the successful measured requests in
    send order, each copy's cache primed with its successful warm-ups."""
    reused = total = 0
    for domain in sorted({s.cache_domain for s in sent}):
        mine = sorted((s for s in sent if s.cache_domain == domain and s.record.ok), key=lambda s: s.record.send_time)
        seen: set = set()
        block_reuse((s.turn.prompt_ids for s in mine if s.warmup), block_size, seen)
        r, n = block_reuse((s.turn.prompt_ids for s in mine if not s.warmup), block_size, seen)
        reused, total = reused + r, total + n
    return reused, total


def summarize_point(sent: list[Sent], percentiles: list[float], block_size: int) -> dict:
    """The measured requests' numbers (metrics.summarize: TTFT, per-request ITL = TPOT -> interactivity, pooled
    ITL, E2EL, throughput with cached input, achieved hit rate) plus the theoretical hit rate, errors by kind,
    subagent share and the speculative-decoding acceptance length (None: no speculative decoding yet)."""
    measured = [s for s in sent if not s.warmup]
    if not measured:
        raise ValueError("no measured requests: the run ended before its first profiled request")
    records = [s.record for s in measured]
    out = metrics.summarize(records, percentiles)
    reused, total = theoretical_reuse(sent, block_size)
    out["theoretical_prefix_hit_rate"] = reused / total if total else None
    out["theoretical_cached_tokens"] = reused
    out["errors_by_kind"] = metrics.error_kinds(records)
    out["subagent_requests"] = sum(1 for s in measured if s.subagent)
    out["warmup_requests"] = len(sent) - len(measured)
    out["warmup_failed"] = sum(1 for s in sent if s.warmup and not s.record.ok)
    out["acceptance_length"] = None
    return out


async def _run_point(base_url: str, model: str | None, config: AgenticConfig, spec: PointSpec,
                     api_key: str | None, transport: httpx.AsyncBaseTransport | None) -> tuple[PointRunner, str]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(spec.request_timeout_s, connect=30.0), limits=limits,
                                 transport=transport) as client:
        if model is None:
            model = await serve._served_model(client, SimpleNamespace(base_url=base_url, api_key=api_key))
        runner = PointRunner(client, base_url, model, config, spec, api_key)
        await runner.run()
    return runner, model


def _run_coroutine(coro):
    """asyncio.run, also from inside a running event loop (a notebook's): then in a worker thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def run_point(base_url: str, config: AgenticConfig, spec: PointSpec, *, model: str | None = None,
              api_key: str | None = None, transport: httpx.AsyncBaseTransport | None = None,
              keep_requests: bool = False) -> dict:
    """Run one point; returns {"concurrency", "summary", ...} (JSON-ready). `transport` replaces the network."""
    runner, model = _run_coroutine(_run_point(base_url, model, config, spec, api_key, transport))
    sent, st = runner.state.sent, runner.state
    summary = summarize_point(sent, list(spec.percentiles), config.block_size)
    result = {"concurrency": spec.concurrency, "model": model, "seed": spec.seed, "salt": spec.salt,
              "summary": summary, "trees_started": st.trees_started, "trees_finished": st.trees_finished,
              "max_requests_in_flight": st.max_in_flight}
    if spec.mirror_ranks:
        start = runner.profile_start + (spec.mirror_ranks - 1) * spec.mirror_lag_s
        end = min(runner.copy_ends.values())
        measured = [s.record for s in sent if not s.warmup]
        result["mirror"] = {"ranks": spec.mirror_ranks, "lag_s": spec.mirror_lag_s,
                            "pins_confirmed": sum(1 for p in runner.pins if p),
                            "pins_unconfirmed": sum(1 for p in runner.pins if p is None),
                            "pins_misplaced": sum(1 for p in runner.pins if p is False),
                            "window_s": max(0.0, end - start),
                            "window_token_throughput": metrics.window_token_throughput(measured, start, end)}
    if keep_requests:
        result["requests"] = [{**vars(s.record), "warmup": s.warmup, "subagent": s.subagent,
                               "cache_domain": s.cache_domain} for s in sent]
    return result
