"""The memory-map guard: it raises before the programs compiled next would pass vm.max_map_count, reads /proc only
as often as the headroom requires, and the runner consults it before every compile."""

import sys

import jax
import jax.numpy as jnp
import pytest

import dsv41
from serving.runtime import map_limit
from serving.runtime.config import RuntimeConfig
from serving.runtime.map_limit import MapLimitGuard
from serving.runtime.runner import Runner


class FakeProcess:
    """A process whose every compiled program adds `per_program` maps under a cap of `limit`."""

    def __init__(self, start: int, per_program: int, limit: int):
        self.count, self.per_program, self.limit, self.reads = start, per_program, limit, 0

    def read(self):
        self.reads += 1
        return self.count, self.limit

    def compile(self, guard: MapLimitGuard):
        guard.before_compile()
        self.count += self.per_program


def test_raises_while_the_next_programs_still_fit_and_reads_rarely():
    proc = FakeProcess(start=500, per_program=800, limit=65_530)
    guard = MapLimitGuard(proc.read)
    with pytest.raises(RuntimeError, match=r"vm.max_map_count = 65,530.*sysctl -w vm.max_map_count") as err:
        for _ in range(200):
            proc.compile(guard)
    assert proc.count + 800 <= proc.limit  # stopped before the program that would not fit
    assert proc.count + 2 * 800 > proc.limit - 2 * 800  # and not long before: within a couple of programs
    assert guard.per_program == 800 and "~800" in str(err.value) and "jax.clear_caches()" in str(err.value)
    assert proc.reads < 20  # ~80 programs compiled, /proc read about every half of the headroom


def test_nothing_to_read_is_no_check():
    guard = MapLimitGuard(lambda: None)
    for _ in range(5):
        guard.before_compile()
    assert guard.per_program == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_this_process_maps_and_limit():
    count, limit = map_limit.memory_maps()
    assert 0 < count < limit and limit == int(open("/proc/sys/vm/max_map_count").read())


def test_the_runner_asks_before_compiling(monkeypatch):
    proc = FakeProcess(start=65_000, per_program=800, limit=65_530)
    guard = MapLimitGuard(proc.read)
    guard.per_program = 800  # as learned from earlier programs of this process
    monkeypatch.setattr(map_limit, "GUARD", guard)
    runner = Runner(dsv41.random_model("tiny", seed=0), RuntimeConfig(max_num_seqs=2, max_num_batched_tokens=8,
                                                                      max_model_len=64, token_buckets=(8,)),
                    progress=False)
    with pytest.raises(RuntimeError, match="memory maps"):
        runner.compiler.precompile()
    assert runner.compiler.compiled_keys == [] and proc.reads == 1


def test_the_suite_releases_compiled_programs_past_a_quarter_of_the_limit():
    from tests.conftest import release_compiled_programs

    f = jax.jit(lambda x: x * 3 + 1)
    f(jnp.ones(3))
    assert f._cache_size() == 1
    assert not release_compiled_programs(reader=lambda: (16_000, 65_530))  # under a quarter: kept
    assert not release_compiled_programs(reader=lambda: None)  # nothing to read: kept
    assert f._cache_size() == 1
    assert release_compiled_programs(reader=lambda: (16_500, 65_530))
    assert f._cache_size() == 0
    assert float(f(jnp.ones(3))[0]) == 4.0  # compiles again when used
