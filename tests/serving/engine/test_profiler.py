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


# ---- a GPU trace, written as jax.profiler writes one (tsl/profiler/protobuf/xplane.proto field numbers); no GPU here
def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _num(field: int, value: int) -> bytes:
    return _varint(field << 3) + _varint(value)


def _msg(field: int, *parts: bytes | str) -> bytes:
    body = b"".join(p.encode() if isinstance(p, str) else p for p in parts)
    return _varint(field << 3 | 2) + _varint(len(body)) + body


STAT_IDS = {"hlo_op": 1, "hlo_module": 2, "program_id": 3, "Hlo Proto": 4}


def _plane(name: str, lines: list[tuple[str, list[tuple[str, int, int, dict]]]], embedded: dict | None = None):
    """An XPlane: lines of (event name, start us, duration us, stats); `embedded`: module name -> {op: op_name},
    written as the `/host:metadata` plane embeds a program's HLO."""
    names, parts = {}, [_msg(2, name)]
    for i, (line, events) in enumerate(lines):
        evs = []
        for ev, start_us, dur_us, stats in events:
            mid = names.setdefault(ev, len(names) + 1)
            st = [_msg(4, _num(1, STAT_IDS[k]), _num(4, v) if isinstance(v, int) else _msg(5, v))
                  for k, v in stats.items()]
            evs.append(_msg(4, _num(1, mid), _num(2, start_us * 10**6), _num(3, dur_us * 10**6), *st))
        parts.append(_msg(3, _num(1, i + 1), _msg(2, line), _num(3, 10**9), *evs))
    for module, ops in (embedded or {}).items():
        instructions = [_msg(2, _msg(1, op), _msg(7, _msg(2, op_name))) for op, op_name in ops.items()]
        hlo = _msg(1, _msg(3, *instructions))  # HloProto.hlo_module.computations[0].instructions
        md = _msg(2, _num(1, 100), _msg(2, f"{module}(7)"), _msg(5, _num(1, STAT_IDS["Hlo Proto"]), _msg(6, hlo)))
        parts.append(_msg(4, _num(1, 100), md))
    for ev, mid in names.items():
        parts.append(_msg(4, _num(1, mid), _msg(2, _num(1, mid), _msg(2, ev))))
    for stat, sid in STAT_IDS.items():
        parts.append(_msg(5, _num(1, sid), _msg(2, _num(1, sid), _msg(2, stat))))
    return _msg(1, *parts)


def test_a_gpu_trace_reads_the_device_streams_and_their_idle_gaps(tmp_path):
    """On a GPU the kernels are on the device plane's streams: their time goes to the ops' scopes, the host's launch
    events (which name the same ops) are not device time, a lane derived from the streams is not counted twice, a
    kernel without an op counts under its name, and the timeline splits the span into busy time and idle gaps."""
    op = {"hlo_module": "jit_step", "program_id": 7}
    attn, ffn = dict(op, hlo_op="fusion.1"), dict(op, hlo_op="custom-call.2")
    kernels = [("loop_fusion", 100, 50, attn), ("pallas_moe", 160, 100, ffn), ("loop_fusion", 400, 10, attn)]
    xspace = b"".join([
        _plane("/host:CPU", [("python", [("engine.step", 90, 330, {})]),
                             ("launcher", [("fusion.1", 95, 3, attn), ("custom-call.2", 99, 3, ffn)])]),
        _plane("/device:GPU:0", [("Stream #7(Compute)", kernels), ("Stream #8(MemcpyH2D)", [("MemcpyH2D", 150, 5, {})]),
                                 ("XLA Ops", [("fusion.1", 100, 50, attn)])]),
        _plane("/host:metadata", [], embedded={"jit_step": {
            "fusion.1": "jit(step)/segment1/layer_0/attn/dot_general",
            "custom-call.2": "jit(step)/segment2/layer_5/ffn/pallas_call"}}),
    ])
    (tmp_path / "gpu.xplane.pb").write_bytes(xspace)
    report = read_trace(tmp_path)
    assert report.phases["engine.step"].count == 1 and report.unmatched == 0
    layers = {k: (s.count, s.ns) for k, s in report.by_scope(2).items()}
    assert layers == {"segment1/layer_0": (2, 60_000), "segment2/layer_5": (1, 100_000),
                      "(no hlo_op)": (1, 5_000)}, layers
    (t,) = report.timelines
    assert (t.device, t.streams, t.kernels, t.kernel_ns) == ("/device:GPU:0", 2, 4, 165_000)
    assert (t.window_ns, t.busy_ns, t.idle_ns, t.gaps_ns) == (310_000, 165_000, 145_000, [140_000, 5_000])
    assert report.to_json()["devices"][0]["longest_gaps_us"] == [140.0, 5.0]
