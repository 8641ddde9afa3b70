"""EngineArgs: flat keywords routed to their sections, one name per knob, errors that name the field; `LLM`
takes the same flat keywords and refuses unknown ones before loading anything."""

import argparse
import dataclasses
from dataclasses import dataclass, field

import pytest

from serving.engine.args import EngineArgs, FlagError, add_flags, field_names, from_flags, to_flags
from serving.engine.scheduler import SchedulerConfig
from serving.runtime.config import RuntimeConfig
from sharding.eplb import EplbConfig
from sharding.mesh import ParallelConfig


def test_flat_keywords_go_to_their_sections():
    a = EngineArgs.of(max_num_seqs=16, block_size=8, scheduling_policy="priority", data_parallel_size=2,
                      enable_expert_parallel=True, enable_eplb=True, eplb_step_interval=5)
    assert a.runtime == RuntimeConfig(max_num_seqs=16, block_size=8)
    assert a.scheduler == SchedulerConfig(scheduling_policy="priority")
    assert a.parallel == ParallelConfig(data_parallel_size=2, enable_expert_parallel=True)
    assert a.eplb == EplbConfig(enable_eplb=True, eplb_step_interval=5)
    assert EngineArgs.of(**a.flat()) == a and EngineArgs.of() == EngineArgs()
    b = a.replace(max_num_seqs=4, dp_routing_policy="load")
    assert (b.runtime.max_num_seqs, b.scheduler.dp_routing_policy, b.runtime.block_size) == (4, "load", 8)


def test_sections_have_titles_and_distinct_field_names():
    sections = EngineArgs.sections()
    assert list(sections) == [f.name for f in dataclasses.fields(EngineArgs)]
    assert [sec for sec, _ in sections.values()] == [RuntimeConfig, SchedulerConfig, ParallelConfig, EplbConfig]
    assert all(title for _, title in sections.values())
    names = [n for sec, _ in sections.values() for n in field_names(sec)]
    assert len(names) == len(set(names)) == len(EngineArgs.field_names())


@pytest.mark.parametrize("flat, message", [
    (dict(max_num_seqs=0), "max_num_seqs must be positive"),
    (dict(kernel_impl="cuda"), "kernel_impl must be one of"),
    (dict(moe_small_steps="fastest"), "moe_small_steps must be one of"),
    (dict(kv_cache_dtype="fp8"), "kv_cache_dtype must be one of"),
    (dict(scheduling_policy="x"), "scheduling_policy must be one of"),
    (dict(dp_routing_policy="random"), "dp_routing_policy must be one of"),
    (dict(dp_max_inflight=0), "dp_max_inflight must be >= 1"),
    (dict(eplb_window_size=0), "eplb_window_size must be >= 1"),
    (dict(enable_eplb=True), "enable_eplb needs enable_expert_parallel"),
])
def test_bad_values_name_the_field(flat, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs.of(**flat)


def test_unknown_keywords_are_type_errors_naming_them():
    with pytest.raises(TypeError, match="EngineArgs got an unexpected keyword argument 'max_seqs'"):
        EngineArgs.of(max_seqs=4)
    from serving import LLM

    with pytest.raises(TypeError, match="LLM got an unexpected keyword argument 'bogus'"):
        LLM(bogus=1)


@dataclass(frozen=True)
class _Knobs:
    count: int = field(default=2, metadata={"help": "how many", "aliases": ("-c",)})
    name: str | None = None
    mode: str = field(default="a", metadata={"choices": ("a", "b"), "flag": "--knob-mode"})
    sizes: tuple[int, ...] | None = None
    on: bool = True
    off: bool = False

    def __post_init__(self):
        if self.count < 1:
            raise ValueError(f"count must be >= 1, got {self.count}")


def _parse(argv):
    p = argparse.ArgumentParser()
    add_flags(p, _Knobs, "knobs")
    return from_flags(_Knobs, p.parse_args(argv))


def test_flags_from_fields_names_types_and_back():
    got = _parse(["-c", "3", "--name", "x", "--knob-mode", "b", "--sizes", "1,2", "--no-on", "--off"])
    assert got == _Knobs(3, "x", "b", (1, 2), False, True)
    assert to_flags(got) == ["--count", "3", "--name", "x", "--knob-mode", "b", "--sizes", "1,2", "--no-on", "--off"]
    assert _parse(to_flags(got)) == got and _parse([]) == _Knobs() and to_flags(_Knobs()) == []
    with pytest.raises(FlagError, match="argument --count: count must be >= 1, got 0"):
        _parse(["--count", "0"])
    with pytest.raises(SystemExit):  # argparse refuses a value outside the choices
        _parse(["--knob-mode", "c"])
