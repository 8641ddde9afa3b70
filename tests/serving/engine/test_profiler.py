"""The profiler's start/stop contract and the trace reader, on a small jitted function traced in this process:
misuse is a ProfilerError naming the problem, a trace lands in its own session folder, and the reader finds the
annotations and attributes the device ops to the function's named scopes."""

import gzip
import json

import jax
import jax.numpy as jnp
import pytest

from serving.engine.profiler import Profiler, ProfilerError, profiling
from serving.engine.trace_report import _self_times, read_trace, scope_path


def test_misuse_is_an_error_naming_the_problem(tmp_path):
    for call in (Profiler(None).start, Profiler(None).stop):
        with pytest.raises(ProfilerError, match="profiling is off: no --profile-dir"):
            call()
    p = Profiler(tmp_path)
    with pytest.raises(ProfilerError, match="no trace is running"):
        p.stop()
    p.start()
    try:
        with pytest.raises(ProfilerError, match="already running"):
            p.start()
    finally:
        p.stop()
    assert not p.active
    with profiling(None) as nothing:
        assert nothing is None


def test_a_trace_has_the_annotations_and_the_named_scopes(tmp_path):
    @jax.jit
    def f(x):
        with jax.named_scope("outer"), jax.named_scope("inner"):
            return jnp.cumsum(jnp.tanh(x @ x.T), axis=0)

    x = jnp.ones((64, 64))
    f(x).block_until_ready()  # compiled before the trace
    with profiling(tmp_path, "unit test") as p:
        for _ in range(3):
            with jax.profiler.TraceAnnotation("engine.test_phase"):
                f(x).block_until_ready()
    trace = p.last
    assert trace.folder.parent == tmp_path / "plugins" / "profile" and trace.folder.name.endswith("_unit_test")
    assert trace.xplane is not None and trace.perfetto is not None
    names = {e.get("name") for e in json.load(gzip.open(trace.perfetto))["traceEvents"]}
    assert "engine.test_phase" in names  # the annotations are in the Perfetto JSON too

    report = read_trace(tmp_path)  # the newest trace under the folder
    assert report.phases["engine.test_phase"].count == 3
    assert report.unmatched == 0 and report.device_ns > 0
    scoped = report.by_scope(2)
    assert "outer/inner" in scoped and scoped["outer/inner"].count >= 3  # at least one op per call
    # every op of f is in its scopes, or one XLA added (no op_name: counted under the module)
    assert set(scoped) <= {"outer/inner", "jit_f"}


def test_scope_paths_and_self_times():
    assert scope_path("jit(<lambda>)/segment1/layer_3/attn/...i,oi->...o/dot_general") == [
        "segment1", "layer_3", "attn"]
    assert scope_path("jit(<lambda>)/segment1/layer_0/div") == ["segment1", "layer_0"]
    assert scope_path("jit(segment1)/segment1/jit(segment1_rows)/layer_0/attn/dot_general") == [
        "segment1", "layer_0", "attn"]  # a nested jit's scopes continue its caller's
    assert scope_path("jit(sample)/top_k") == ["sample"]
    assert scope_path("(copy)", "jit_seg") == ["jit_seg"]
    # a loop [0, 10) holding two ops [1, 3) and [4, 8), the second holding [5, 6); then a sibling [10, 12)
    events = [(0, 10, {}), (1, 3, {}), (4, 8, {}), (5, 6, {}), (10, 12, {})]
    assert _self_times(events) == [4, 2, 3, 1, 2]  # sums to the outer intervals' 12
