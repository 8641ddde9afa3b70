"""One server over several processes (one per host) on JAX's distributed runtime.

Every process runs `python -m serving.server` with the same flags but its own `--node-rank` (SGLang's names:
`--nnodes`, `--node-rank`, `--dist-init-addr`), loads its shards of the model onto its devices and compiles the
same global step programs; the mesh spans every process's devices (`sharding.mesh.make_mesh`). Rank 0 serves
HTTP and runs the engine - scheduler, batch building, sampling parameters - as on one process: each step it plans
the host inputs (`Runner.plan` -> `HostStep`, numpy only) and publishes them under a step-numbered key of the
key-value store of JAX's coordination service (the service `jax.distributed` already runs on rank 0; Orbax keeps
its multi-host state there too); every other rank reads the steps in order and dispatches the same programs on its
devices (`Runner.execute`), whose collectives tie the processes together. vLLM's multi-node executor broadcasts its
scheduler output to the workers the same way (over shared memory or ZMQ). What crosses per step is the
`HostStep` pickled (`StepChannel.publish` returns its bytes and time, /metrics sums them;
`serving.bench.multiprocess` measures them against one process).

Before anything is loaded the processes compare their settings (`check_same_settings`): processes started with
different flags would compile different programs and wait for each other forever in their first collective.

Faults. Every other rank sets its heartbeat key every HEARTBEAT_S and, when a step fails on it, a failure key
naming the error before it exits. Rank 0's `ProcessWatch` reads them every HEARTBEAT_S; a rank whose heartbeat has
not moved for `--dead-rank-timeout` seconds (exited, killed, stopped) or that reported a failure is dead: the
server answers 503 to new and waiting requests, ends every open stream with an error, `/health` names the rank,
and rank 0 exits with status 1 EXIT_GRACE_S later (its engine thread may be blocked in a collective with the dead
rank, so it does not wait for it). The other ranks end as soon as rank 0 is gone: their next call to its coordination
service fails, and JAX ends the process. JAX's own heartbeat timeout (JAX_HEARTBEAT_TIMEOUT_S) is set above the
watch's, so that rank 0 answers and exits as above rather than being aborted by JAX first. A clean stop of rank 0
(Ctrl-C, SIGTERM) publishes `Stop` and every rank exits 0.

EPLB decides on rank 0 (from its expert counts); a rearrangement is published as `Rebalance` between the two
steps it falls between, and every rank migrates its shards of the experts there.

Every step program is compiled (or loaded from the executable cache, each process its own) before ready on every
rank: rank 0 picks a step's buckets among the compiled ones, and every rank must hold the same.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax

from serving.runtime.outputs import HostStep, LaunchedStep
from sharding.mesh import ParallelConfig

log = logging.getLogger("serving.engine")

PREFIX = "dsv41"
HEARTBEAT_S = 0.25
EXIT_GRACE_S = 3.0  # rank 0's error events and 503s reach the clients before it exits
JAX_HEARTBEAT_TIMEOUT_S = 30  # the coordination service's own detection: a last resort behind ProcessWatch
WINDOW = 64  # published steps kept in the store; the collectives keep every rank within a step or two of rank 0
START_TIMEOUT_S = 3600  # loading and compiling on every rank before the ready barrier


@dataclass(frozen=True)
class Execute:
    """Run this step's programs; `reads_prev`: its rows read the previous step's sampled tokens on the device."""

    host: HostStep
    reads_prev: bool


@dataclass(frozen=True)
class Rebalance:
    """EPLB moved the experts between two steps: lay them out as `placement` (sharding.eplb.Placement) too."""

    placement: object


@dataclass(frozen=True)
class Stop:
    """Rank 0 stops; every rank exits 0."""

    reason: str


Message = Execute | Rebalance | Stop


class ProcessFailed(RuntimeError):
    """A process of a multi-process server died or stopped answering; the message names it."""


def join(pc: ParallelConfig) -> None:
    """Start this process on JAX's distributed runtime (rank 0 also starts the coordination service); call before
    anything starts JAX's backends. CPU devices talk over gloo."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(pc.dist_init_addr, pc.nnodes, pc.node_rank,
                               heartbeat_timeout_seconds=max(JAX_HEARTBEAT_TIMEOUT_S, pc.dead_rank_timeout + 10))


def check_same_settings(settings: dict, rank: int, nnodes: int, timeout_s: float = START_TIMEOUT_S) -> None:
    """Every process must serve with the same settings (`settings`: field name -> value, its rank and the other
    per-process fields left out), or the processes would compile different programs and hang in their first
    collective. Process 0 compares every other process's with its own, the others theirs with process 0's; a
    difference is a ValueError naming each differing flag and both values."""
    client = _client()
    client.key_value_set_bytes(f"{PREFIX}/settings/{rank}", pickle.dumps(settings))

    def of(r: int) -> dict:
        return pickle.loads(client.blocking_key_value_get_bytes(f"{PREFIX}/settings/{r}", int(timeout_s * 1000)))

    for other in range(1, nnodes) if rank == 0 else (0,):
        theirs = of(other)
        diff = [f"--{k.replace('_', '-')} {settings.get(k)!r} here, {theirs.get(k)!r} on process {other}"
                for k in sorted(settings.keys() | theirs.keys()) if settings.get(k) != theirs.get(k)]
        if diff:
            raise ValueError(f"process {rank}'s settings differ from process {other}'s (every process must run "
                             f"the same flags but --node-rank): " + "; ".join(diff))


def _client():
    from jax._src import distributed
    if distributed.global_state.client is None:
        raise RuntimeError("JAX's distributed runtime is not started (multiprocess.join)")
    return distributed.global_state.client


def wait_for_every_rank(name: str, timeout_s: float = START_TIMEOUT_S) -> None:
    """A barrier of every process (e.g. every rank has compiled its programs)."""
    _client().wait_at_barrier(f"{PREFIX}/{name}", int(timeout_s * 1000))


def shutdown() -> None:
    jax.distributed.shutdown()


class StepChannel:
    """The steps rank 0 publishes, in order, read by every other rank."""

    def __init__(self):
        self._client = _client()
        self.steps = 0  # published, or received

    def publish(self, msg: Message) -> tuple[int, float]:
        """(bytes, seconds) of this message."""
        t = time.perf_counter()
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        self._client.key_value_set_bytes(self._key(self.steps), data)
        if self.steps >= WINDOW:
            self._client.key_value_delete(self._key(self.steps - WINDOW))
        self.steps += 1
        return len(data), time.perf_counter() - t

    def receive(self) -> Message:
        """The next step (waits as long as rank 0 is idle; a dead rank 0 ends this process through JAX)."""
        while True:
            try:
                data = self._client.blocking_key_value_get_bytes(self._key(self.steps), 1000)
            except Exception as e:  # noqa: BLE001 - the binding raises its runtime error type
                if "DEADLINE_EXCEEDED" in str(e):
                    continue
                raise
            self.steps += 1
            return pickle.loads(data)

    @staticmethod
    def _key(n: int) -> str:
        return f"{PREFIX}/step/{n}"


def follow(runner, channel: StepChannel, rank: int) -> int:
    """A rank other than 0: run rank 0's steps until it stops (0), or report the failure and return 1. The heartbeat
    runs in a thread from here on."""
    beat = _Heartbeat(rank)
    beat.start()
    prev: LaunchedStep | None = None
    try:
        while True:
            match channel.receive():
                case Execute(host=host, reads_prev=reads_prev):
                    prev = runner.execute(host, prev if reads_prev else None)
                case Rebalance(placement=placement):
                    runner.model.apply_placement(placement)
                    runner.reload_params()
                case Stop(reason=reason):
                    log.info("rank %d: rank 0 stopped (%s)", rank, reason)
                    return 0
    except Exception as e:  # noqa: BLE001 - any failure here ends the server: say it to rank 0 first
        log.exception("rank %d: step failed", rank)
        try:
            _client().key_value_set_bytes(f"{PREFIX}/failed/{rank}", repr(e).encode(), allow_overwrite=True)
        except Exception:  # noqa: BLE001 - rank 0 (and the store) gone: nobody to tell
            pass
        return 1
    finally:
        beat.stop()


class _EveryBeat:
    """A daemon thread calling `beat(client)` every HEARTBEAT_S until `stop()`, or until a beat returns True."""

    def __init__(self, name: str):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        client = _client()
        while not self._stop.wait(HEARTBEAT_S):
            if self.beat(client):
                return

    def beat(self, client) -> bool:
        raise NotImplementedError


class _Heartbeat(_EveryBeat):
    """A rank other than 0: a counter under its heartbeat key, moved every beat."""

    def __init__(self, rank: int):
        super().__init__("rank-heartbeat")
        self.key, self.n = f"{PREFIX}/alive/{rank}", 0

    def beat(self, client) -> bool:
        self.n += 1
        client.key_value_set_bytes(self.key, str(self.n).encode(), allow_overwrite=True)
        return False


class ProcessWatch(_EveryBeat):
    """Rank 0: every other rank's heartbeat and failure keys, read every HEARTBEAT_S; `on_failure(ProcessFailed)` once,
    for the first rank found dead."""

    def __init__(self, nnodes: int, timeout_s: float, on_failure: Callable[[ProcessFailed], None]):
        super().__init__("rank-watch")
        self.nnodes, self.timeout_s, self.on_failure = nnodes, timeout_s, on_failure
        self.seen: dict[int, tuple[bytes, float]] = {}  # rank -> (last heartbeat value, when it changed)

    def start(self) -> None:
        now = time.monotonic()
        self.seen = {r: (b"", now) for r in range(1, self.nnodes)}
        super().start()

    def beat(self, client) -> bool:
        failure = self._check(client, self.seen, time.monotonic())
        if failure is not None:
            log.error("%s", failure)
            self.on_failure(failure)
        return failure is not None

    def _check(self, client, seen: dict, now: float) -> ProcessFailed | None:
        for key, value in client.key_value_dir_get_bytes(f"{PREFIX}/failed/"):
            return ProcessFailed(f"process {key.rsplit('/', 1)[-1]} failed: {value.decode(errors='replace')}")
        beats = {int(k.rsplit("/", 1)[-1]): v for k, v in client.key_value_dir_get_bytes(f"{PREFIX}/alive/")}
        for rank, (value, since) in seen.items():
            if beats.get(rank, value) != value:
                seen[rank] = (beats[rank], now)
            elif now - since > self.timeout_s:
                return ProcessFailed(f"process {rank} stopped answering (no heartbeat for {now - since:.1f} s)")
        return None
