"""The background compile's gate (serving/runtime/background.py) on a fake clock: nothing compiles beside busy steps
until the padding they lost for want of a program (half a step's seconds times the padded fraction of its rows)
reaches its compile seconds, the most lost first; an idle engine compiles the most wanted, then the rest in order;
idle gaps are no step's seconds; the sampler's padding costs nothing."""

import pytest

from serving.runtime.background import DEFAULT_COMPILE_S, BackgroundGate
from serving.runtime.programs import Program

S1, S2, SAMPLE = Program.SEGMENT1, Program.SEGMENT2, Program.SAMPLE


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _gate(busy: bool = True):
    clock = Clock()
    gate = BackgroundGate(idle_s=1.0, clock=clock)
    state = {"busy": busy}
    gate.busy = lambda: state["busy"]
    return gate, clock, state


def _step(gate, clock, seconds: float, s1=(32, 32), s2=(32, 32), sample=(32, 32)) -> None:
    """One step: each program's (wanted, used) size, then `seconds` pass."""
    gate.planned(S1, *s1)
    gate.planned(S2, *s2)
    gate.planned(SAMPLE, *sample)
    clock.t += seconds


def test_an_idle_engine_compiles_in_the_given_order():
    gate, _, _ = _gate(busy=False)
    assert gate.choose([S1.at(8), S1.at(16), S2.at(8)]) == S1.at(8)


def test_busy_steps_wait_until_their_padding_lost_a_compile():
    gate, clock, _ = _gate()
    pending = [S1.at(8), S2.at(8), SAMPLE.at(8)]
    gate.compiled(S1.at(32), 4.0)  # the segment-1 family compiles in 4 s here
    assert gate.cost(S1.at(8)) == 4.0 and gate.cost(S2.at(8)) == 4.0  # a family not measured yet: any program's
    # 8-row decode steps padded to 32 rows in both segments, 32 ms each: half of it each segment's, 3/4 of that
    # padding: 12 ms lost for each program a step; its 4 s after 334 steps (a step's loss is counted when the
    # next is planned)
    for _ in range(300):
        _step(gate, clock, 0.032, s1=(8, 32), s2=(8, 32), sample=(8, 32))
    assert gate.choose(pending) is None
    for _ in range(35):
        _step(gate, clock, 0.032, s1=(8, 32), s2=(8, 32), sample=(8, 32))
    assert gate.choose(pending) in (S1.at(8), S2.at(8))
    assert gate.loss_s[S1.at(8)] == pytest.approx(334 * 0.012)
    assert gate.loss_s[SAMPLE.at(8)] == 0.0  # the sampler's padding is not counted


def test_the_program_that_lost_most_goes_first():
    gate, clock, _ = _gate()
    for _ in range(700):  # 8 ms a step lost for want of segment1[16] (half its rows padded), 12 ms for segment2[8]
        _step(gate, clock, 0.032, s1=(16, 32), s2=(8, 32))
    assert gate.loss_s[S2.at(8)] > gate.loss_s[S1.at(16)] >= DEFAULT_COMPILE_S
    assert gate.choose([S1.at(16), S2.at(8)]) == S2.at(8)


def test_idle_for_idle_s_compiles_the_most_wanted():
    gate, clock, state = _gate()
    for _ in range(10):
        _step(gate, clock, 0.040, s2=(8, 32))
    state["busy"] = False
    assert gate.choose([S1.at(8), S2.at(8)]) is None  # idle for 0.04 s only
    clock.t += 1.0
    assert gate.choose([S1.at(8), S2.at(8)]) == S2.at(8)  # wanted by ten steps, not yet worth a compile beside them


def test_an_idle_gap_is_not_a_steps_seconds():
    gate, clock, state = _gate()
    _step(gate, clock, 600.0, s2=(8, 32))  # then ten idle minutes, seen by the gate
    state["busy"] = False
    gate.idle()
    state["busy"] = True
    _step(gate, clock, 0.040, s2=(8, 32))
    assert gate.loss_s[S2.at(8)] == 0.0
    _step(gate, clock, 0.040)
    assert gate.loss_s[S2.at(8)] == pytest.approx(0.040 / 2 * 0.75)


def test_the_decode_bucket_of_every_slot_is_bought_when_a_many_request_step_first_pads_past_it():
    """The server is ready without the segments' decode buckets of every slot; the first step of more requests than
    the few-row bucket holds that fits one and pads up past it makes it due at once (no renting). Not so a step of
    few requests (a prompt's last small chunk beside decodes), one on its own bucket, or one too large for it."""
    clock = Clock()
    gate = BackgroundGate(idle_s=1.0, clock=clock, decode_buckets={S1: 32, S2: 32}, few_rows=8)
    gate.busy = lambda: True
    pending = [S1.at(16), S1.at(32), S2.at(32), S1.at(128)]

    def step(s1, s2, requests):
        gate.planned(S1, *s1, requests)
        gate.planned(S2, *s2, requests)
        clock.t += 0.05

    step((8, 8), (8, 8), 8)  # a few-row decode on its own bucket
    step((14, 512), (14, 512), 8)  # a last chunk of 7 tokens beside 7 decodes, padded up: rented
    step((128, 512), (128, 512), 12)  # a prefill padded up: rented
    assert gate.choose(pending) is None and not gate.urgent
    step((16, 512), (32, 512), 16)  # 16 decodes and their kept rows pad up to the prefill bucket
    assert gate.urgent == {S1.at(32), S2.at(32)}
    assert gate.choose(pending) in (S1.at(32), S2.at(32)) and not gate.due(S1.at(16))
