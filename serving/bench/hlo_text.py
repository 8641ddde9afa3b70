"""What the benchmarks read from program text: an array's bytes, and the collectives ({op: {count, bytes}}) of a
compiled HLO module (`sharding_report`'s collective traffic) or of lowered StableHLO (`full_size_lowering`'s
explicit collectives); `layer_scan` sizes the scan's weight slices with `hlo_array_bytes`. Text in, numbers out:
no jax, nothing compiled here."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable

import numpy as np

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# bytes per element as each text spells the type (unknown types count 4)
_HLO_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "s64": 8, "f64": 8,
              "f8e4m3fn": 1}
_STABLEHLO_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "i32": 4, "ui32": 4, "i8": 1, "ui8": 1, "i1": 1, "i64": 8,
                    "f64": 8, "f8E4M3FN": 1}
_OP = re.compile(r"=\s*(\(.*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+(" + "|".join(COLLECTIVES) +
                 r")(?:-start)?\(")
_SHLO_OP = re.compile(r"stablehlo\.(all_reduce|all_gather|reduce_scatter|all_to_all|collective_permute)\b")
_FUNC = re.compile(r"func\.func (?:public |private )?@([\w.$-]+)\(")
_CALL = re.compile(r"call @([\w.$-]+)\(")
_TENSOR = re.compile(r"tensor<((?:\d+x)*)([a-z]+[0-9a-zA-Z]*)>")


def hlo_array_bytes(dtype: str, dims: str) -> int:
    """Bytes of an HLO array `dtype[dims]` as the text writes it ("bf16", "16,256"; "" for a scalar)."""
    return _HLO_BYTES.get(dtype, 4) * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))


def merged(parts: Iterable[dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
    """{op: {count, bytes}} summed over several such counts (e.g. a step's two segments)."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"count": 0, "bytes": 0})
    for part in parts:
        for op, v in part.items():
            out[op]["count"] += v["count"]
            out[op]["bytes"] += v["bytes"]
    return dict(out)


def collective_bytes(hlo_text: str) -> dict[str, dict[str, int]]:
    """{op: {count, bytes}} of the collectives in a compiled HLO module (result shapes)."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"count": 0, "bytes": 0})
    for m in _OP.finditer(hlo_text):
        shape, op = m.groups()
        nbytes = sum(hlo_array_bytes(dt, dims) for dt, dims in re.findall(r"([a-z0-9]+)\[([0-9,]*)\]", shape))
        out[op]["count"] += 1
        out[op]["bytes"] += nbytes
    return dict(out)


def _tensor_bytes(types: str) -> int:
    return sum(_STABLEHLO_BYTES.get(dt, 4) * int(np.prod([int(d) for d in dims.split("x") if d] or [1]))
               for dims, dt in _TENSOR.findall(types))


def stablehlo_collectives(text: str) -> dict[str, dict[str, int]]:
    """{op: {count, bytes}} of the explicit collectives in StableHLO text (result tensor types, per device),
    each function's counted as many times as it is called from @main."""
    direct: dict[str, list[tuple[str, int]]] = defaultdict(list)
    calls: dict[str, list[str]] = defaultdict(list)
    fn, pending = "", None
    for line in text.splitlines():
        if m := _FUNC.search(line):
            fn = m.group(1)
            continue
        if m := _SHLO_OP.search(line):
            if line.rstrip().endswith("({"):  # a reduction region: the types close it
                pending = m.group(1)
            else:
                direct[fn].append((m.group(1), _tensor_bytes(line.rsplit("->", 1)[-1])))
        elif pending and line.lstrip().startswith("})"):
            direct[fn].append((pending, _tensor_bytes(line.rsplit("->", 1)[-1])))
            pending = None
        for callee in _CALL.findall(line):
            calls[fn].append(callee)

    out: dict[str, dict[str, int]] = defaultdict(lambda: {"count": 0, "bytes": 0})

    def visit(f: str, times: int, depth: int = 0) -> None:
        if depth > 64:
            raise ValueError(f"call depth over 64 at @{f}")
        for op, nbytes in direct.get(f, ()):
            out[op]["count"] += times
            out[op]["bytes"] += times * nbytes
        for callee in calls.get(f, ()):
            visit(callee, times, depth + 1)

    visit("main", 1)
    return dict(out)
