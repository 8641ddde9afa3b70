"""tools/compile_bill.py: every XLA compile of every process a command starts is logged with its cache key, a
program compiled again is counted as such, a process that does not import JAX is left without it, and a
sitecustomize the tool's own hides still runs."""

import os
import subprocess
import sys

from tests.conftest import xla_env
from tools import compile_bill

# jit the same function twice with JAX's in-memory caches cleared between: the second compile is a repeat
_CHILD = """
import sys
assert "jax" not in sys.modules, "the logger imported jax before the process did"
import jax, jax.numpy as jnp
from serving.runtime.compiler import enable_compilation_cache
enable_compilation_cache(sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)  # compile every time, never read back
def twice_plus_one(x):
    return x * 2 + 1
jax.jit(twice_plus_one)(jnp.arange(5.0)).block_until_ready()
jax.clear_caches()
jax.jit(twice_plus_one)(jnp.arange(5.0)).block_until_ready()
"""


def test_a_command_s_compiles_are_logged_and_repeats_counted(tmp_path, monkeypatch):
    for name, value in xla_env(1).items():
        monkeypatch.setenv(name, value)
    log = tmp_path / "log"
    no_jax = subprocess.run([sys.executable, compile_bill.__file__, "run", str(log), "--", sys.executable, "-c",
                             "import sys; assert 'jax' not in sys.modules"], capture_output=True, text=True)
    assert no_jax.returncode == 0, no_jax.stderr
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import builtins; builtins.THEIRS_RAN = True\n")
    path = os.pathsep.join(p for p in (str(theirs), os.environ.get("PYTHONPATH")) if p)
    shadowed = subprocess.run([sys.executable, compile_bill.__file__, "run", str(log), "--", sys.executable, "-c",
                               "import builtins; assert builtins.THEIRS_RAN"], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": path})
    assert shadowed.returncode == 0, shadowed.stderr
    assert compile_bill.run(log, [sys.executable, "-c", _CHILD, str(tmp_path / "cache")]) == 0
    rows = compile_bill.read_log(log)
    mine = [r for r in rows if r["name"].startswith("jit_twice_plus_one")]
    assert len(mine) == 2 and mine[0]["key"] == mine[1]["key"] and all(r["kind"] == "compile" for r in mine), rows
    bill = compile_bill.bill(rows)
    assert bill["compiles"] == len(rows) and bill["repeated_compiles"] >= 1
    by_module = {name: n for name, n, _ in bill["by_module"]}
    assert by_module["jit_twice_plus_one"] == 2
    assert bill["model_programs"] == 0
