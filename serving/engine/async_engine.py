"""The engine loop for the server: `Engine.step` runs in one dedicated thread (the device work releases the
GIL, so the event loop keeps serving HTTP meanwhile); requests and aborts reach it as typed commands
(`AddRequest`, `Abort`) through a queue drained before every step, and each step's outputs go back to the event
loop in one callback.

A client that stops listening (disconnect, cancelled task) aborts its request: `generate`'s `finally`
queues the abort, and the engine frees the blocks before its next step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from serving.engine.engine import Engine
from serving.engine.request import RequestOutput
from serving.runtime.sampling_params import SamplingParams

log = logging.getLogger("serving.engine")


class EngineDead(RuntimeError):
    """The engine loop stopped after an internal error; the server reports unhealthy."""


@dataclass(frozen=True)
class AddRequest:
    """Queue a request (`Engine.add_request`); `accepted` is answered on the event loop: done, or the error
    refusing it."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    session_id: str | None
    cache_salt: str | None
    accepted: asyncio.Future


@dataclass(frozen=True)
class Abort:
    """End a request wherever it is (`Engine.abort`); an unknown or ended one is ignored."""

    request_id: str


Command = AddRequest | Abort


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.error: BaseException | None = None
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread.is_alive()

    # -------------------------------------------------------------- event-loop side
    async def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, *, priority: int = 0,
                     session_id: str | None = None, cache_salt: str | None = None) -> "RequestStream":
        """Queue a request; raises ValueError (bad request), QueueFull or EngineDead before anything streams."""
        if not self.healthy:
            raise EngineDead(f"the engine stopped: {self.error!r}")
        accepted = self._loop.create_future()
        stream = RequestStream(self, request_id)
        self._streams[request_id] = stream.queue
        self._submit(AddRequest(request_id, prompt_ids, params, priority, session_id, cache_salt, accepted))
        try:
            await accepted
        except BaseException:
            self._streams.pop(request_id, None)
            if not accepted.done() or accepted.cancelled():  # cancelled while waiting: it may get admitted
                self._submit(Abort(request_id))
            raise
        return stream

    def _submit(self, cmd: Command) -> None:
        if not isinstance(cmd, Command):
            raise TypeError(f"not an engine command: {cmd!r}")
        self._cmds.put(cmd)
        self._wake.set()

    def _deliver(self, outs: list[RequestOutput]) -> None:
        for o in outs:
            stream = self._streams.get(o.request_id)
            if stream is not None:
                stream.put_nowait(o)

    # ------------------------------------------------------------------ engine side
    def _run(self) -> None:
        eng = self.engine
        while not self._stopping:
            self._wake.clear()
            self._drain()
            if not eng.has_unfinished():
                self._wake.wait()
                continue
            try:
                outs = eng.step()
            except Exception as e:  # a bug, not bad input: fail everything in flight and report unhealthy
                log.exception("engine step failed")
                self.fail(e)
                return
            if outs:
                self._loop.call_soon_threadsafe(self._deliver, outs)

    def _queued(self):
        """The commands queued so far, oldest first (stops when the queue is empty)."""
        while True:
            try:
                yield self._cmds.get_nowait()
            except queue.Empty:
                return

    def _drain(self) -> None:
        for cmd in self._queued():
            match cmd:
                case AddRequest():
                    try:
                        self.engine.add_request(cmd.request_id, cmd.prompt_ids, cmd.params, priority=cmd.priority,
                                                session_id=cmd.session_id, cache_salt=cmd.cache_salt)
                    except Exception as e:  # ValueError / QueueFull: the caller's answer
                        self._loop.call_soon_threadsafe(_set_exception, cmd.accepted, e)
                    else:
                        self._loop.call_soon_threadsafe(_set_result, cmd.accepted)
                case Abort():
                    if self.engine.abort(cmd.request_id) is not None:
                        log.info("aborted %s", cmd.request_id)

    def fail(self, error: BaseException) -> None:
        """From any thread: the engine is dead (a rank of a multi-process server died, or a step raised). Every
        open stream ends with an error, queued and new requests are refused (EngineDead: 503), and the engine
        thread stops at its next turn (it may stay blocked on the devices)."""
        first, self.error, self._stopping = self.error is None, error, True  # /health shows the latest cause
        self._wake.set()
        if first:
            self._loop.call_soon_threadsafe(self._fail_all, f"the engine stopped: {error!r}")

    def _fail_all(self, message: str) -> None:
        """On the event loop: every stream gets an error output; requests not yet accepted get EngineDead."""
        self._deliver([RequestOutput(rid, [], "", True, "abort", error=message) for rid in list(self._streams)])
        for cmd in self._queued():
            if isinstance(cmd, AddRequest):
                _set_exception(cmd.accepted, EngineDead(message))


class RequestStream:
    """One request's outputs; iterate it, and `close()` (or leave the iteration early) to abort it."""

    def __init__(self, engine: AsyncEngine, request_id: str):
        self.engine, self.request_id = engine, request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                out: RequestOutput = await self.queue.get()
                if out.error is not None:
                    raise EngineDead(out.error)
                self.finished = out.finished
                yield out
        finally:
            self.close()

    def close(self) -> None:
        """Abort unless finished; idempotent. The engine frees the blocks before its next step."""
        if self.engine._streams.pop(self.request_id, None) is not None and not self.finished:
            self.engine._submit(Abort(self.request_id))


def _set_result(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _set_exception(fut: asyncio.Future, e: BaseException) -> None:
    if not fut.done():
        fut.set_exception(e)
