"""The async engine's command queue (no model: a stand-in engine records the calls): requests and aborts travel as
typed commands, each applied by its type in order; anything else is refused where it is queued; a refused request
answers its caller; a closed stream aborts its request."""

import asyncio

import pytest

from serving.engine.async_engine import Abort, AddRequest, AsyncEngine
from serving.engine.request import RequestOutput
from serving.runtime.sampling_params import SamplingParams


class _Engine:
    """The `Engine` calls the loop makes: each request finishes one step after it is added."""

    def __init__(self):
        self.calls, self.live = [], []

    def add_request(self, request_id, prompt_ids, params, *, priority=0, session_id=None, cache_salt=None):
        if not prompt_ids:
            raise ValueError("prompt is empty")
        self.calls.append(("add", request_id, tuple(prompt_ids), priority, session_id, cache_salt))
        self.live.append(request_id)

    def abort(self, request_id):
        self.calls.append(("abort", request_id))
        if request_id not in self.live:
            return None
        self.live.remove(request_id)
        return RequestOutput(request_id, [], "", True, "abort")

    def has_unfinished(self):
        return bool(self.live)

    def step(self):
        done, self.live = self.live, []
        return [RequestOutput(rid, [7], "x", True, "length") for rid in done]


def _run(coro_fn):
    async def main():
        eng = _Engine()
        ae = AsyncEngine(eng)
        ae.start(asyncio.get_running_loop())
        try:
            return eng, await asyncio.wait_for(coro_fn(ae, eng), 30)
        finally:
            ae.shutdown()
    return asyncio.run(main())


def test_commands_are_typed_and_applied_by_type():
    async def go(ae, eng):
        stream = await ae.submit("a", [1, 2], SamplingParams(), priority=3, session_id="s", cache_salt="salt")
        outs = [o async for o in stream]
        with pytest.raises(ValueError, match="empty"):  # the engine's refusal reaches the caller
            await ae.submit("b", [], SamplingParams())
        held = await ae.submit("c", [3], SamplingParams())
        held.close()  # before its output was read: an abort
        while ("abort", "c") not in eng.calls:
            await asyncio.sleep(0.01)
        return outs

    eng, outs = _run(go)
    assert [o.finish_reason for o in outs] == ["length"]
    assert eng.calls[0] == ("add", "a", (1, 2), 3, "s", "salt")
    assert ("add", "c", (3,), 0, None, None) in eng.calls
    assert not any(c[:2] == ("add", "b") for c in eng.calls)


def test_anything_but_a_command_is_refused_where_it_is_queued():
    async def go(ae, eng):
        with pytest.raises(TypeError, match="not an engine command"):
            ae._submit(("abort", "a"))
        ae._submit(Abort("nobody"))  # an unknown request: ignored
        while not eng.calls:
            await asyncio.sleep(0.01)
        return ae.healthy

    eng, healthy = _run(go)
    assert healthy and eng.calls == [("abort", "nobody")]


def test_commands_are_frozen():
    cmd = Abort("a")
    with pytest.raises(AttributeError):
        cmd.request_id = "b"
    assert AddRequest.__dataclass_params__.frozen
