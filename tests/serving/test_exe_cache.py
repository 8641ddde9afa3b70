"""The executable cache across restarts (fresh processes: the suite's own process runs JAX's cache, which this
one replaces): the second start loads every program and the segment carry's shapes without tracing, and its steps
equal the first start's bit for bit, on one device and on a mesh; other settings, or damaged entries, miss and
compile. The folder keeps to its
size bound, least recently used entries first; one that cannot be written warns and misses."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import HANG_TIMEOUT_S, xla_env

_START = r"""
import json, sys
import numpy as np
import dsv41
from serving.runtime import segments
from serving.runtime.config import RuntimeConfig
from pathlib import Path
from serving.runtime.exe_cache import ExecutableCacheSettings
from serving.runtime.runner import Runner
from tests.serving.driver import Driver

folder, max_num_seqs, out, forbid_tracing = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
mesh = sys.argv[5] == "1"
settings = ExecutableCacheSettings(Path(folder) / "executables")
if forbid_tracing:
    def traced(*a, **k):
        raise AssertionError("a segment was traced although its programs and the carry are cached")
    segments.segment1 = segments.segment2 = traced
rc = RuntimeConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=16, max_model_len=64, block_size=8,
                   token_buckets=(16,))
model = dsv41.random_model("tiny", seed=3)
if mesh:  # data parallel 2 x tensor parallel 2
    from sharding.mesh import ParallelConfig
    from sharding.model import ShardedModel
    from sharding.runtime import MeshPlacement

    sm = ShardedModel(model, ParallelConfig(tensor_parallel_size=2, data_parallel_size=2))
    r = Runner(sm, rc, progress=False, placement=MeshPlacement(sm.mesh), executable_cache=settings)
else:
    r = Runner(model, rc, progress=False, executable_cache=settings)
r.compiler.precompile()
d = Driver(r)
d.start("a", [int(t) for t in np.random.default_rng(0).integers(3, 500, 21)])
logits = [d.step({"a": 16})["a"], d.step({"a": 5})["a"]]
d.append("a", int(np.argmax(logits[-1])))
logits.append(d.step({"a": 1})["a"])
np.save(out, np.stack(logits))
print(json.dumps({"hits": r.compiler.exe_cache.hits, "misses": r.compiler.exe_cache.misses}))
"""


def _start(folder, tmp_path, max_num_seqs=2, forbid_tracing=False, mesh=False) -> tuple[dict, np.ndarray]:
    """One start on 8 CPU devices (a loaded program must land on the device or mesh it was compiled for)."""
    out = tmp_path / f"logits_{max_num_seqs}_{forbid_tracing}_{mesh}.npy"
    done = subprocess.run([sys.executable, "-c", _START, str(folder), str(max_num_seqs), str(out),
                           str(int(forbid_tracing)), str(int(mesh))], capture_output=True, text=True, env=xla_env(8),
                          cwd=Path(__file__).resolve().parents[2], timeout=HANG_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1]), np.load(out)


def test_restart_loads_every_program_without_tracing(tmp_path):
    folder = tmp_path / "cache"
    first, want = _start(folder, tmp_path)
    assert first == {"hits": 0, "misses": 3}  # seg1 and seg2 at 16 tokens, sampling
    second, got = _start(folder, tmp_path, forbid_tracing=True)
    assert second == {"hits": 3, "misses": 0}
    np.testing.assert_array_equal(got, want)
    other, _ = _start(folder, tmp_path, max_num_seqs=3)  # other settings: other programs
    assert other == {"hits": 0, "misses": 3}
    for path in (folder / "executables").glob("*.pkl"):
        path.write_bytes(b"damaged")
    again, got = _start(folder, tmp_path)
    assert again == {"hits": 0, "misses": 3}
    np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_a_mesh_runner_restarts_from_its_programs(tmp_path):
    """The same on a data-parallel 2 x tensor-parallel 2 mesh: its programs carry their shardings and load onto
    the mesh's devices, without tracing, and step bit for bit as the first start."""
    folder = tmp_path / "cache"
    first, want = _start(folder, tmp_path, mesh=True)
    assert first == {"hits": 0, "misses": 3}
    second, got = _start(folder, tmp_path, forbid_tracing=True, mesh=True)
    assert second == {"hits": 3, "misses": 0}
    np.testing.assert_array_equal(got, want)


def test_the_folder_keeps_the_most_recently_used_entries_within_its_bound(tmp_path):
    """After a write the least recently used entries go until the rest fit; a load counts as a use."""
    from serving.runtime.exe_cache import ExecutableCache, ExecutableCacheSettings

    unbounded = ExecutableCache(ExecutableCacheSettings(tmp_path, max_bytes=None), "runner")
    for n, name in enumerate("abcd"):
        unbounded.put_value(name, b"x" * 10_000)
        os.utime(unbounded._path(f"value {name}"), ns=(n * 10**9, n * 10**9))  # written at t = 0, 1, 2, 3 s
    assert unbounded.get_value("a") == b"x" * 10_000  # a use: now the most recent
    size = unbounded._path("value a").stat().st_size
    bounded = ExecutableCache(ExecutableCacheSettings(tmp_path, max_bytes=3 * size + size // 2), "runner")
    bounded.put_value("e", b"x" * 10_000)
    assert [name for name in "abcde" if bounded.get_value(name) is not None] == ["a", "d", "e"]
    assert sum(p.stat().st_size for p in tmp_path.glob("*.pkl")) <= bounded.max_bytes


def test_a_folder_that_cannot_be_written_warns_and_misses(tmp_path):
    """A cache that cannot store (here its folder is a file) never stops the runner: a warning, then misses."""
    from serving.runtime.exe_cache import ExecutableCache, ExecutableCacheSettings

    (tmp_path / "taken").write_text("a file, not a folder")
    cache = ExecutableCache(ExecutableCacheSettings(tmp_path / "taken"), "runner")
    with pytest.warns(UserWarning, match="not written"):
        cache.put_value("carry", 1)
    assert cache.get_value("carry") is None and list(tmp_path.iterdir()) == [tmp_path / "taken"]


def test_no_program_is_kept_beside_jax_s_persistent_cache(tmp_path):
    """This process runs JAX's persistent cache (tests/conftest.py), whose programs serialize without their code on
    jaxlib 0.12: the executable cache keeps none (a warning says why), so no later load fails."""
    import jax
    import jax.numpy as jnp

    from serving.runtime.exe_cache import ExecutableCache, ExecutableCacheSettings

    assert jax.config.jax_compilation_cache_dir and jax.config.jax_enable_compilation_cache
    cache = ExecutableCache(ExecutableCacheSettings(tmp_path), "runner")
    spec = (jax.ShapeDtypeStruct((), jnp.float32),)
    with pytest.warns(UserWarning, match="persistent compilation cache is on"):
        cache.save("bucket", spec, jax.jit(lambda x: x + 1).lower(*spec).compile())
    assert list(tmp_path.iterdir()) == [] and cache.load("bucket", spec, jax.devices()) is None
