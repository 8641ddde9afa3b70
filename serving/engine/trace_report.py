"""What a `jax.profiler` trace of the engine holds: host time per engine phase, device time per op and per named
scope (segment, layer, block part).

Where the names are (XLA:CPU, jax 0.12): the phases are `TraceAnnotation` events on the engine's host thread, in the
xplane and the Perfetto JSON alike. A device op is an event named after its HLO instruction (`fusion.12`) with the
stats `hlo_module`, `hlo_op` and `program_id`; the named scopes (`segment1/layer_3/attn`) are only in the op_name
metadata of the HLO modules that the xplane's `/host:metadata` plane embeds, one per program - never in the JSON.
`jax.profiler.ProfileData` does not expose that plane's event metadata, so it is read here from the protobuf wire
format. A program loaded from the persistent compilation cache runs under another program id than the one its
embedded module carries, so an op's program is found by name: the embedded module of the same name whose
instructions contain every op the program ran.

On a GPU the kernels (and copies) are events on the device plane's stream lines (`/device:GPU:0`, `Stream #7(Compute)`),
carrying the same three stats when XLA annotated their launch; the host threads then hold the launches, which are
not device time. So where a trace has a device plane its ops are read from there only, a kernel without `hlo_op`
(e.g. one inside a CUDA graph that XLA's command buffer replayed) counts under its kernel name, and each device gets
a timeline: the time any stream ran a kernel against the idle gaps between them (`DeviceTimeline`).

Device time is self time: nested ops (a while loop's body) run inside their parent on the same thread, and a
parent's time excludes them, so totals add up.
"""

from __future__ import annotations

import re
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import jax

PHASE_PREFIXES = ("engine.", "runner.")  # the engine's TraceAnnotation names
UNATTRIBUTED = "(no hlo_op)"  # the module of a device kernel no XLA op annotated
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass
class Stat:
    count: int = 0
    ns: int = 0

    def add(self, ns: int) -> None:
        self.count += 1
        self.ns += ns


@dataclass
class DeviceTimeline:
    """One GPU's kernels (and copies) against its idle time, from the first kernel's start to the last one's end:
    `busy_ns` is when any stream ran a kernel, `idle_ns` the rest (launch gaps, host round trips, waiting for the
    host), `gaps_ns` each idle stretch, longest first."""

    device: str
    streams: int
    kernels: int
    kernel_ns: int  # summed over streams (kernels on two streams at once count twice)
    busy_ns: int
    window_ns: int
    gaps_ns: list[int]

    @property
    def idle_ns(self) -> int:
        return self.window_ns - self.busy_ns

    @classmethod
    def of(cls, device: str, lines: list) -> DeviceTimeline:
        spans = [(start, end) for _, evs in lines for _, start, end, _ in evs]
        busy = _union(spans)
        gaps = sorted((b[0] - a[1] for a, b in zip(busy, busy[1:])), reverse=True)
        return cls(device, sum(1 for _, evs in lines if evs), len(spans), sum(e - s for s, e in spans),
                   sum(e - s for s, e in busy), busy[-1][1] - busy[0][0] if busy else 0, gaps)

    def to_json(self, gaps: int = 10) -> dict:
        return {"device": self.device, "streams": self.streams, "kernels": self.kernels,
                "kernel_ms": self.kernel_ns / 1e6, "busy_ms": self.busy_ns / 1e6, "idle_ms": self.idle_ns / 1e6,
                "window_ms": self.window_ns / 1e6, "idle_gaps": len(self.gaps_ns),
                "longest_gaps_us": [g / 1e3 for g in self.gaps_ns[:gaps]]}


@dataclass
class TraceReport:
    xplane: Path
    phases: dict[str, Stat] = field(default_factory=dict)  # annotation name -> host time
    ops: dict[tuple[str, str], Stat] = field(default_factory=dict)  # (module, op_name) -> device self time
    unmatched: int = 0  # device op events whose op_name was not found
    timelines: list[DeviceTimeline] = field(default_factory=list)  # per GPU (none on XLA:CPU)

    @property
    def device_ns(self) -> int:
        return sum(s.ns for s in self.ops.values())

    def by_scope(self, depth: int) -> dict[str, Stat]:
        """Device self time per named-scope path cut to `depth` components (1: segment, 2: segment/layer,
        3: segment/layer/part)."""
        out: dict[str, Stat] = defaultdict(Stat)
        for (module, op_name), s in self.ops.items():
            key = "/".join(scope_path(op_name, module)[:depth])
            out[key].count += s.count
            out[key].ns += s.ns
        return dict(out)

    def to_json(self, top: int = 20) -> dict:
        def rows(d: dict[str, Stat]) -> list[dict]:
            return [{"name": k, "count": s.count, "total_ms": s.ns / 1e6} for k, s in _ranked(d)]

        top_ops = [{"op_name": op, "module": module, "count": s.count, "total_ms": s.ns / 1e6}
                   for (module, op), s in _ranked(self.ops)[:top]]
        return {"xplane": str(self.xplane), "device_ms": self.device_ns / 1e6, "unmatched_op_events": self.unmatched,
                "phases": rows(self.phases), "segments": rows(self.by_scope(1)), "layers": rows(self.by_scope(2)),
                "scopes": rows(self.by_scope(3)), "top_ops": top_ops,
                "devices": [t.to_json() for t in self.timelines]}


def scope_path(op_name: str, module: str = "") -> list[str]:
    """The named scopes of an op (`jit(f)/segment1/layer_3/attn/.../dot_general` -> segment1, layer_3, attn, ...):
    the leading identifier components between the function and the primitive. An op in no scope counts under its
    function (`jit(sample)/top_k` -> sample), one without metadata under its module."""
    parts = op_name.split("/")
    names = []
    for p in parts[1:-1]:
        if p.startswith("jit(") and p.endswith(")"):  # a nested jit (segment 1's rows): the scopes go on inside it
            continue
        if not _IDENT.fullmatch(p):
            break
        names.append(p)
    if names:
        return names
    head = parts[0]
    if head.startswith("jit(") and head.endswith(")"):
        return [head[4:-1]]
    return [module or "(unknown)"]


def find_xplane(path: str | Path) -> Path:
    """The `.xplane.pb` of a trace: the file itself, or the newest one under a folder (a session folder or a
    whole `--profile-dir`)."""
    p = Path(path)
    if p.is_file():
        return p
    found = sorted(p.rglob("*.xplane.pb"), key=lambda f: f.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no .xplane.pb under {p}")
    return found[-1]


def read_trace(path: str | Path) -> TraceReport:
    xplane = find_xplane(path)
    raw = xplane.read_bytes()
    modules = embedded_modules(raw)
    report = TraceReport(xplane)
    op_events: dict[tuple[str, int], list] = defaultdict(list)  # (module, program id) -> (hlo_op, self ns)
    with warnings.catch_warnings():  # jaxlib's stats type warns "has no __module__" on Python 3.12: noise
        warnings.simplefilter("ignore", DeprecationWarning)
        planes = [(plane.name, [(line.name, [(ev.name, int(ev.start_ns), int(ev.end_ns), dict(ev.stats))
                                             for ev in line.events]) for line in plane.lines])
                  for plane in jax.profiler.ProfileData.from_serialized_xspace(raw).planes]
    gpus = [(name, _kernel_lines(lines)) for name, lines in planes if name.startswith("/device:GPU")]
    gpus = [(name, lines) for name, lines in gpus if any(evs for _, evs in lines)]
    for _, lines in planes:
        for _, thread in lines:
            for name, start, end, _ in thread:
                if name.startswith(PHASE_PREFIXES):
                    report.phases.setdefault(name, Stat()).add(end - start)
    if gpus:  # the GPUs' kernels; the host threads' events that name an op are their launches
        threads = [evs for _, lines in gpus for _, evs in lines]
        report.timelines = [DeviceTimeline.of(name, lines) for name, lines in gpus]
    else:  # XLA:CPU runs its ops on host threads
        threads = [evs for _, lines in planes for _, evs in lines]
    for thread in threads:
        events = [(start, end, stats, name) for name, start, end, stats in thread
                  if "hlo_op" in stats or (gpus and not name.startswith(PHASE_PREFIXES))]
        for (_, _, stats, name), ns in zip(events, _self_times(events)):
            if "hlo_op" in stats:
                op_events[stats.get("hlo_module", ""), stats.get("program_id", -1)].append((stats["hlo_op"], ns))
            else:  # a kernel no op annotated (e.g. one replayed inside a CUDA graph): counted under its own name
                report.ops.setdefault((UNATTRIBUTED, name), Stat()).add(ns)
    for (module, _), evs in op_events.items():
        ran = {op for op, _ in evs}
        instructions = _match_program(modules.get(module, []), ran)
        names = {op: _op_name(instructions[op]) for op in ran if op in instructions}
        for op, ns in evs:
            op_name = names.get(op)
            if op_name is None:
                report.unmatched += 1
                op_name = op
            elif not op_name:  # an op XLA added (a copy, a layout change): named by its kind
                op_name = f"({op.rsplit('.', 1)[0]})"
            report.ops.setdefault((module, op_name), Stat()).add(ns)
    return report


def _kernel_lines(lines: list) -> list:
    """A device plane's lines that hold its kernels: its streams (`Stream #7(Compute)`) where it names them, so lines
    a tool derived from them (`XLA Ops`, `XLA Modules`, `Steps`) do not count their time twice."""
    streams = [line for line in lines if line[0].startswith("Stream")]
    return streams or lines


def _union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The disjoint spans covered by [start, end) intervals, in order."""
    out: list[list[int]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def format_report(r: TraceReport, top: int = 20) -> str:
    total = r.device_ns or 1
    out = [f"trace: {r.xplane}"]

    def table(title: str, d: dict, n: int | None = None, share: bool = True) -> None:
        out.append(f"\n{title}\n{'ms':>10} {'%':>6} {'count':>7}  name")
        for k, s in _ranked(d)[:n]:
            pct = f"{100 * s.ns / total:6.1f}" if share else f"{'':>6}"
            out.append(f"{s.ns / 1e6:10.3f} {pct} {s.count:7d}  {k}")

    table("host time by engine phase (TraceAnnotation; nested: engine.step holds the others)", r.phases, share=False)
    for t in r.timelines:
        out.append(f"\n{t.device}: {t.kernels} kernels on {t.streams} streams over {t.window_ns / 1e6:.3f} ms; "
                   f"busy {t.busy_ns / 1e6:.3f} ms ({100 * t.busy_ns / max(t.window_ns, 1):.1f}%), idle "
                   f"{t.idle_ns / 1e6:.3f} ms in {len(t.gaps_ns)} gaps (longest, us: "
                   f"{', '.join(f'{g / 1e3:.1f}' for g in t.gaps_ns[:5]) or '-'})")
    table(f"device self time by segment (total {r.device_ns / 1e6:.3f} ms)", r.by_scope(1))
    table("by layer", r.by_scope(2), top)
    table("by named scope", r.by_scope(3), top)
    table(f"top {top} ops", {f"{op}  [{m}]": s for (m, op), s in r.ops.items()}, top)
    if r.unmatched:
        out.append(f"\n{r.unmatched} op events had no op_name in the embedded HLO (counted under their HLO name)")
    return "\n".join(out)


def _ranked(d: dict) -> list:
    return sorted(d.items(), key=lambda kv: -kv[1].ns)


def _self_times(events: list) -> list[int]:
    """Each event's duration minus the events nested in it (one thread: intervals nest or are disjoint)."""
    order = sorted(range(len(events)), key=lambda i: (events[i][0], -events[i][1]))
    self_ns = [int(e[1] - e[0]) for e in events]
    stack: list[int] = []
    for i in order:
        start, end = events[i][0], events[i][1]
        while stack and events[stack[-1]][1] <= start:
            stack.pop()
        if stack and end <= events[stack[-1]][1]:
            self_ns[stack[-1]] -= end - start
        stack.append(i)
    return [max(ns, 0) for ns in self_ns]


def _match_program(candidates: list[dict], ops: set[str]) -> dict:
    """The embedded module (its instructions by name) that holds the most of the ops a program ran (all of them,
    unless the trace lost its module)."""
    return max(candidates, key=lambda instructions: len(ops & instructions.keys()), default={})


# ------------------------------------------------------------------------------------ protobuf wire format
# XSpace.planes=1; XPlane.name=2, event_metadata=4 (map<int64, XEventMetadata>), stat_metadata=5
# (map<int64, XStatMetadata>); XEventMetadata.name=2, stats=5; XStatMetadata.id=1, name=2; XStat.metadata_id=1,
# bytes_value=6; HloProto.hlo_module=1; HloModuleProto.computations=3; HloComputationProto.instructions=2;
# HloInstructionProto.name=1, metadata=7; OpMetadata.op_name=2. (tsl/profiler/protobuf/xplane.proto, xla/xla_data
# and xla/service/hlo.proto.)

def embedded_modules(xspace: bytes) -> dict[str, list[dict]]:
    """HLO module name -> per embedded module of that name, its instructions by name (undecoded: a module has tens
    of thousands, a step runs a few thousand; `_op_name` reads one)."""
    out: dict[str, list[dict]] = defaultdict(list)
    for num, plane in _fields(memoryview(xspace)):
        if num != 1 or _text(_first(plane, 2)) != "/host:metadata":
            continue
        stat_names = {}
        for k, entry in _fields(plane):
            if k == 5:
                md = _first(entry, 2)
                stat_names[_int(_first(md, 1))] = _text(_first(md, 2))
        for k, entry in _fields(plane):
            if k != 4:
                continue
            md = _first(entry, 2)
            for s_num, stat in _fields(md):
                if s_num == 5 and stat_names.get(_int(_first(stat, 1))) == "Hlo Proto":
                    module = _text(_first(md, 2)).rsplit("(", 1)[0]  # "jit_sample(110)": name(program id)
                    out[module].append(_instructions(_first(stat, 6)))
    return dict(out)


def _instructions(hlo_proto) -> dict:
    found = {}
    for num, comp in _fields(_first(hlo_proto, 1)):
        if num != 3:
            continue
        for k, ins in _fields(comp):
            if k == 2:
                found[_instruction_name(ins)] = ins
    return found


def _instruction_name(instruction) -> str:
    if instruction[:1] == b"\x0a":  # field 1 (name) is written first: read it directly, the hot path of a trace
        size, i = _varint(instruction, 1)
        return bytes(instruction[i:i + size]).decode("utf-8", "replace")
    return _text(_first(instruction, 1))


def _op_name(instruction) -> str:
    md = _first(instruction, 7)
    return _text(_first(md, 2)) if md is not None else ""


def _varint(b, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = b[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, i


def _fields(b):
    """(field number, value) of one message: an int for varint / fixed fields, a memoryview for length-delimited."""
    i, n = 0, len(b)
    while i < n:
        key, i = _varint(b, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(b, i)
        elif wire == 1:
            value, i = int.from_bytes(b[i:i + 8], "little"), i + 8
        elif wire == 2:
            size, i = _varint(b, i)
            value, i = b[i:i + size], i + size
        elif wire == 5:
            value, i = int.from_bytes(b[i:i + 4], "little"), i + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire} (field {num})")
        yield num, value


def _first(b, num: int):
    return None if b is None else next((v for k, v in _fields(b) if k == num), None)


def _text(v) -> str:
    return "" if v is None else bytes(v).decode("utf-8", "replace")


def _int(v) -> int:
    return 0 if v is None else int(v)
