"""Benchmark of the fused kernels: `python -m serving.bench.kernels [--smoke] [--out FILE]`.

On a GPU (~2-3 min): every kernel at V4.1-Flash sizes is checked against a slower path on the device
(`compare`: float error, or the overlap of selected row-id sets), timed (median of jitted runs: cases moving less
than a few L2s run on several input copies in one program, so no dispatch sits between the timed kernels), and
reported as achieved GB/s and TFLOP/s against ceilings this script measures itself (a copy-bandwidth probe and a
bf16 matmul probe), with the predicted time from docs/gpu/kernel-notes.md's byte and FLOP counts and the speed-up
over the XLA path of the same op (fused Pallas vs XLA). `--smoke` runs tiny sizes with the kernels interpreted, so
the script stays exercised on CPU. Prints each row as it is measured and a table at the end; the JSON is rewritten
after every case, so a run cut short (time limit, device fault) keeps what it measured. Measured on an H200:
`docs/gpu/kernel_bench_h200.json`, summarised in docs/gpu/kernel-notes.md.

MoE routed experts: MXFP4 weights decoded in the kernel (fused) against the XLA path, which decodes each
row tile's expert into a bf16 matrix and then multiplies (unfused); the same kernel on bf16 weights shows
what the 3.8x larger weights cost. Bytes count the weights of the experts the routing touches. If
`tokamax` is importable, its `ragged_dot` on the bf16 weights is timed as well (`others`);
it is optional and not installed on the CPU development machine.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import statistics
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import fp8_linear, indexer, mhc, moe_gmm, moe_xla, router
from pallas_kernels import sparse_attention as sa
from pallas_kernels.expert_weights import QuantizedExperts
from pallas_kernels.tiles import max_tiles, plan_tiles

H200_BYTES_PER_S, H200_FLOPS = 4.8e12, 990e12  # datasheet figures kernel-notes.md predicts with


class Case(NamedTuple):
    name: str
    args: tuple
    kernel: Callable  # the Pallas path
    baseline: Callable  # the XLA path (what runs without the kernel)
    check: Callable  # the oracle the kernel is compared with on the device
    bytes: float
    flops: float
    others: tuple = ()  # (label, fn) further implementations timed on the same args


L2_BYTES = 60e6  # H200: inputs smaller than a few times this are rotated so that timed runs do not read L2 only
# after these CUDA errors every later call fails too (seen on an H200: an out-of-bounds read in one case, then
# "illegal address" from each case after it until the process crashed), so the remaining cases are skipped
DEVICE_FAULTS = ("CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_ILLEGAL_INSTRUCTION", "CUDA_ERROR_LAUNCH_FAILED",
                 "CUDA_ERROR_MISALIGNED_ADDRESS")
SHARED_BYTES = 256e6  # arrays at least this large (expert stacks, caches) are not copied for the rotation


def _median_seconds(fn: Callable, args: tuple, reps: int, calls: int = 1) -> float:
    """Median over `reps` of the seconds per call of `calls` calls dispatched back to back and waited for once: the
    device runs them in order, so a kernel shorter than a dispatch is timed as the dispatch."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def _rotated(args: tuple, nbytes: float, copies: int | None = None) -> list[tuple]:
    """`args` and copies of its arrays under `SHARED_BYTES` (larger ones, e.g. expert stacks, are shared): enough
    that the bytes one call moves, cycled through, are ~4x the L2."""
    n = copies or min(8, max(1, int(np.ceil(4 * L2_BYTES / max(nbytes, 1.0)))))
    copy = lambda x: jnp.array(x, copy=True) if isinstance(x, jax.Array) and x.nbytes < SHARED_BYTES else x
    return [args] + [jax.tree.map(copy, args) for _ in range(n - 1)]


def ceilings(smoke: bool, reps: int) -> dict:
    """Measured copy bandwidth (read + write bytes / s) and bf16 matmul FLOP/s of this device (random operands:
    zeros or ones run faster than real data on an H200)."""
    n = 1 << (16 if smoke else 28)
    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    copy = jax.jit(lambda a: a + 1.0)
    bw = 2 * 4 * n / _median_seconds(copy, (x,), reps)
    m = 256 if smoke else 8192
    a = jax.random.normal(jax.random.key(1), (m, m), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (m, m), jnp.bfloat16)
    mm = jax.jit(lambda p, q: jnp.dot(p, q, preferred_element_type=jnp.float32))
    return {"copy_bytes_per_s": bw, "matmul_flops_per_s": 2 * m ** 3 / _median_seconds(mm, (a, b), reps)}


def _attention_case(rng, name, *, B, ctx, prefill_rows, smoke):
    H, d, W, K, rpb = (16, 64, 16, 32, 16) if smoke else (64, 512, 128, 512, 64)
    T = prefill_rows or B
    R = 1 if prefill_rows else B
    nb_req = -(-ctx // rpb)
    u8 = lambda *s: jnp.asarray(rng.integers(0, 256, s), jnp.uint8)
    # e4m3 bytes below 0x7f (no NaN codes) with a sign bit; UE8M0 scale bytes near 1.0
    ring = (u8(R, W, d + d // 32) & 0x7E | u8(R, W, d + d // 32) & 0x80).at[..., d:].set(120)
    rows = u8(R * nb_req, rpb, d // 2 + d // 16).at[..., d // 2:].set(0x30)
    start = ctx - (T if prefill_rows else 1)
    pos = start + (jnp.arange(T) if prefill_rows else jnp.zeros(T, jnp.int32))
    req = jnp.zeros(T, jnp.int32) if prefill_rows else jnp.arange(T, dtype=jnp.int32)
    # the XLA path's tile plan as the runtime makes it: 8 consecutive rows of the prefill per tile
    tiles = plan_tiles(np.zeros(1, np.int32), np.array([T]), 8, max_tiles(T, 1, 8)) if prefill_rows else None
    meta = sa.AttnMeta(pos.astype(jnp.int32), req, jnp.arange(R, dtype=jnp.int32), jnp.full((R,), start, jnp.int32),
                       jnp.zeros(R, jnp.int32), jnp.arange(R * nb_req, dtype=jnp.int32).reshape(R, nb_req),
                       tiles=tiles)
    n = min(ctx, nb_req * rpb)  # distinct ids per query, as the indexer returns them (-1 past the rows there are)
    topk = jnp.asarray(np.stack([np.concatenate([rng.permutation(n)[:K], -np.ones(max(0, K - n), int)])
                                 for _ in range(T)]), jnp.int32)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
    theta = jnp.asarray(rng.uniform(0, 6, (T, 32 if not smoke else 8)), jnp.float32)
    args = (f(T, H, d), jnp.cos(theta), jnp.sin(theta), jnp.zeros(H, jnp.float32), f(T, d), ring, meta, rows, topk)
    decode = not prefill_rows
    kernel = lambda *a: sa.sparse_mla(*a, out_fp8=False, decode=decode, impl="pallas")
    by = T * (W * (d + d // 32) + K * (d // 2 + d // 16) + H * d * 2 + H * d * 4)
    check = sa.xla if prefill_rows else sa.reference
    return Case(name, args, kernel, sa.xla, check, by, 4.0 * T * H * d * (W + K))


def _router_case(rng, name, *, T, smoke):
    E, D = (48, 128) if smoke else (384, 5120)
    args = (jnp.asarray(rng.standard_normal((T, D)), jnp.bfloat16),
            jnp.asarray(rng.standard_normal((E, D)) / np.sqrt(D), jnp.bfloat16), jnp.zeros(E, jnp.float32))
    kw = dict(top_k=6, scaling=1.5)
    return Case(name, args, lambda *a: router.pallas(*a, **kw), lambda *a: router.xla(*a, **kw),
                lambda *a: router.reference(*a, **kw), 2.0 * (E * D + T * D), 2.0 * T * E * D)


def _indexer_case(rng, name, *, B, ctx, candidates, smoke):
    h, c, rpb, k, n_cand, cbs = (4, 32, 16, 16, 8, 8) if smoke else (32, 128, 256, 512, 2048, 8)
    nb_req = -(-ctx // rpb)
    keys = jnp.asarray(rng.integers(0, 256, (B * nb_req, rpb, c // 2 + c // 32)), jnp.uint8).at[..., c // 2:].set(127)
    meta = indexer.IndexMeta(jnp.full((B,), ctx, jnp.int32), jnp.arange(B, dtype=jnp.int32),
                             jnp.arange(B * nb_req, dtype=jnp.int32).reshape(B, nb_req))
    q = jnp.asarray(rng.standard_normal((B, h, c)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((B, h)), jnp.float32)
    n_blocks = ctx // cbs
    if candidates:
        cand = jnp.asarray(np.stack([rng.permutation(n_blocks)[:n_cand] if n_blocks >= n_cand else
                                     np.pad(np.arange(n_blocks), (0, n_cand - n_blocks), constant_values=-1)
                                     for _ in range(B)]), jnp.int32)
        rows = min(ctx, n_cand * cbs)
        kw = dict(k=k, candidates_TK=cand)
    else:
        rows, kw = ctx, dict(k=k)
    return Case(name, (q, w, keys, meta), lambda *a: indexer.pallas(*a, **kw),
                lambda *a: indexer.xla(*a, **kw), lambda *a: indexer.reference(*a, **kw),
                B * rows * (c // 2 + c // 32), 2.0 * B * rows * h * c)


def _mhc_case(rng, name, *, T, smoke):
    n, D = (4, 128) if smoke else (4, 5120)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    args = (f(T, n, D).astype(jnp.bfloat16), f(T, D).astype(jnp.bfloat16), jax.nn.sigmoid(f(T, n)) * 2,
            jax.nn.softmax(f(T, n, n), -1), jax.nn.sigmoid(f(T, n)), jnp.ones(D, jnp.bfloat16))
    return Case(name, args, lambda *a: mhc.pallas(*a, eps=1e-20), lambda *a: mhc.xla(*a, eps=1e-20),
                lambda *a: mhc.reference(*a, eps=1e-20), 2.0 * T * (2 * n * D + 2 * D), 4.0 * T * n * n * D)


MOE_LIMIT = 10.0


def weight_bytes(w) -> int:
    """Bytes one expert's weight occupies (values + scales, or the float array)."""
    if not isinstance(w, QuantizedExperts):
        return math.prod(w.shape[1:]) * jnp.dtype(w.dtype).itemsize
    return math.prod(w.values.shape[1:]) + math.prod(w.scales.shape[1:])


def _moe_weights(key, smoke: bool, kind: str) -> tuple:
    """V4.1-Flash's expert stacks (`moe_weights`; 7 GB), or tiny ones with `smoke`."""
    return moe_weights(key, *((16, 128, 96) if smoke else (384, 5120, 2304)), kind)


def moe_weights(key, E: int, D: int, I: int, kind: str) -> tuple:
    """Random w1, w3 [E, I, D], w2 [E, D, I]: MXFP4 bytes (any e2m1 code) with the UE8M0 scale that makes
    each weight's std ~ 1/sqrt(fan-in), or float (`kind` a dtype name) with that std. Made on the device."""
    out = []
    for i, (O, In) in enumerate(((I, D), (I, D), (D, I))):
        sub = jax.random.fold_in(key, i)
        if kind != "mxfp4":
            dtype = jnp.bfloat16 if kind == "bf16" else jnp.dtype(kind)
            out.append((jax.random.normal(sub, (E, O, In), jnp.float32) / np.sqrt(In)).astype(dtype))
            continue
        scale_byte = 127 - int(round(np.log2(2.9 * np.sqrt(In))))  # e2m1 codes have std ~2.9
        out.append(QuantizedExperts(jax.random.bits(sub, (E, O, In // 2), jnp.uint8),
                                    jnp.full((E, O, In // 32), scale_byte, jnp.uint8), "mxfp4"))
    return tuple(out)


def _tokamax_experts(tokamax, x, ids, wts, w1_EDI, w3_EDI, w2_EID):
    """The same routed experts through tokamax.ragged_dot (bf16 weights pre-transposed to [E, in, out])."""
    T, k = ids.shape
    E = w1_EDI.shape[0]
    order = jnp.argsort(ids.reshape(-1), stable=True)
    sizes = jnp.zeros(E, jnp.int32).at[ids.reshape(-1)].add(1)
    xs = x.astype(jnp.bfloat16)[order // k]
    dot = lambda a, w: tokamax.ragged_dot(a, w, sizes, preferred_element_type=jnp.float32)
    g = jnp.minimum(dot(xs, w1_EDI), MOE_LIMIT)
    h = g * jax.nn.sigmoid(g) * jnp.clip(dot(xs, w3_EDI), -MOE_LIMIT, MOE_LIMIT) * wts.reshape(-1)[order][:, None]
    y = dot(h.astype(jnp.bfloat16), w2_EID)
    return jnp.zeros_like(y).at[order].set(y).reshape(T, k, -1).sum(axis=1)


def _moe_case(rng, name, weights, *, T: int, kind: str, smoke: bool):
    w1, w3, w2 = weights[kind]
    E, I, D = w1.shape
    k = 4 if smoke else 6
    ids = np.argsort(rng.random((T, E)), axis=1)[:, :k].astype(np.int32)
    wts = rng.uniform(0.5, 1.0, (T, k))
    wts = jnp.asarray(wts / wts.sum(1, keepdims=True) * 1.5, jnp.float32)
    args = (jnp.asarray(rng.standard_normal((T, D)), jnp.bfloat16), jnp.asarray(ids), wts, w1, w3, w2)
    touched = len(np.unique(ids))
    by = touched * (weight_bytes(w1) + weight_bytes(w3) + weight_bytes(w2)) + T * D * (2 + 4)
    others = ()
    if kind == "bf16" and importlib.util.find_spec("tokamax") is not None:
        import tokamax

        t1, t3, t2 = (jnp.swapaxes(w, 1, 2) for w in (w1, w3, w2))
        others = (("tokamax_ragged_dot", lambda x, i, w, *_: _tokamax_experts(tokamax, x, i, w, t1, t3, t2)),)
    kw = dict(limit=MOE_LIMIT)
    return Case(name, args, lambda *a: moe_gmm.pallas(*a, **kw), lambda *a: moe_xla.xla(*a, **kw),
                lambda *a: moe_xla.xla(*a, **kw), by, 2.0 * T * k * 3 * I * D, others)


def fp8_weight(key, O: int, I: int, block: tuple[int, int] = (32, 32)) -> tuple[jax.Array, jax.Array]:
    """Random e4m3 codes [O, I] (positive, below NaN) and the UE8M0 block scales that give outputs of order one."""
    w = jax.random.bits(key, (O, I), jnp.uint8) & 0x7E
    s = jnp.full((-(-O // block[0]), -(-I // block[1])), 127 - int(round(np.log2(40 * np.sqrt(I)))), jnp.uint8)
    return w, s


def _fp8_linear_case(rng, name, *, T: int, smoke: bool):
    """wq_b of V4.1-Flash ([H*d, q_lora] = [32768, 1280], FP8 32x32 blocks): fused decode vs XLA's decode + dot."""
    O, I = (256, 128) if smoke else (32768, 1280)
    w, s = fp8_weight(jax.random.key(2), O, I)
    x = jnp.asarray(rng.standard_normal((T, I)), jnp.bfloat16)
    kw = dict(block=(32, 32), dtype=jnp.bfloat16, out_dtype=jnp.bfloat16)
    by = O * I * (1 + 1 / 1024) + T * (I + O) * 2
    return Case(name, (x, w, s), lambda *a: fp8_linear.pallas(*a, **kw),
                lambda *a: fp8_linear.xla(*a, **kw), lambda *a: fp8_linear.reference(*a, **kw), by, 2.0 * T * O * I)


def cases(smoke: bool, seed: int) -> list[tuple[str, Callable[[], Case]]]:
    """(name, build) of each case in order: a case is built only when its turn comes and only if it is selected,
    so a failure to build one (e.g. out of memory) is that case's error, a filtered run builds only what it times,
    and the MoE expert stacks exist only once a MoE case runs. Case n draws from its own generator (seed, n): a
    filtered run times the inputs of the full one."""
    out = []

    def add(name: str, build: Callable) -> None:
        n = len(out)
        out.append((name, lambda: build(np.random.default_rng((seed, n)), name)))

    attention = lambda B, ctx, rows: (f"sparse_mla prefill rows={rows} ctx={ctx}" if rows
                                      else f"sparse_mla decode B={B} ctx={ctx}")
    indexer_name = lambda B, ctx, candidates: f"indexer {'candidates' if candidates else 'dense'} B={B} ctx={ctx}"
    moe_name = lambda T, kind: f"moe_gmm {kind} " + (f"decode B={T}" if T <= 64 else f"prefill {T} rows")
    if smoke:
        for B, rows in ((2, 0), (1, 4)):
            add(attention(B, 64, rows), functools.partial(_attention_case, B=B, ctx=64, prefill_rows=rows, smoke=True))
        add("router T=5", functools.partial(_router_case, T=5, smoke=True))
        for ctx, cand in ((64, False), (256, True)):
            add(indexer_name(2, ctx, cand), functools.partial(_indexer_case, B=2, ctx=ctx, candidates=cand, smoke=True))
        add("mhc_post_pre T=5", functools.partial(_mhc_case, T=5, smoke=True))
        add("fp8_linear wq_b T=5", functools.partial(_fp8_linear_case, T=5, smoke=True))
        add(moe_name(5, "mxfp4"), lambda rng, name: _moe_case(
            rng, name, {"mxfp4": _moe_weights(jax.random.key(1), True, "mxfp4")}, T=5, kind="mxfp4", smoke=True))
        return out
    for ctx in (8192, 131072):
        for B in (1, 8, 64):
            add(attention(B, ctx, 0), functools.partial(_attention_case, B=B, ctx=ctx, prefill_rows=0, smoke=False))
    add(attention(1, 8192, 4096), functools.partial(_attention_case, B=1, ctx=8192, prefill_rows=4096, smoke=False))
    for T in (1, 8, 64, 4096):
        add(f"router T={T}", functools.partial(_router_case, T=T, smoke=False))
    for B, ctx, cand in [(B, ctx, True) for ctx in (8192, 131072) for B in (1, 8, 64)] + [(1, 8192, False),
                                                                                          (64, 8192, False)]:
        add(indexer_name(B, ctx, cand), functools.partial(_indexer_case, B=B, ctx=ctx, candidates=cand, smoke=False))
    for T in (1, 64, 4096):
        add(f"mhc_post_pre T={T}", functools.partial(_mhc_case, T=T, smoke=False))
    for T in (1, 64, 8192):
        add(f"fp8_linear wq_b T={T}", functools.partial(_fp8_linear_case, T=T, smoke=False))
    weights = {}  # each kind's expert stacks (7 / 27 GB), made by the first case that needs them

    def moe(rng, name, T: int, kind: str) -> Case:
        if kind not in weights:
            weights[kind] = _moe_weights(jax.random.key(1), False, kind)
        return _moe_case(rng, name, weights, T=T, kind=kind, smoke=False)

    for kind, Ts in (("mxfp4", (1, 8, 64, 4096)), ("bf16", (1, 64, 4096))):
        for T in Ts:
            add(moe_name(T, kind), functools.partial(moe, T=T, kind=kind))
    return out


def compare(out, ref) -> dict:
    """How the kernel's output agrees with the check's: over float leaves the max |difference| and the relative
    error ||out - ref|| / ||ref||; over integer leaves (selected row ids, whose order among near-equal scores may
    differ) the mean overlap of each row's id set with the check's, ignoring -1 padding (1.0: the same sets)."""
    diff, err2, ref2, overlaps = 0.0, 0.0, 0.0, []
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        a, b = np.asarray(a), np.asarray(b)
        if np.issubdtype(b.dtype, np.integer):
            for x, y in zip(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])):
                want = set(y[y >= 0].tolist())
                overlaps.append(len(want & set(x[x >= 0].tolist())) / len(want) if want else float(not (x >= 0).any()))
            continue
        a, b = a.astype(np.float64), b.astype(np.float64)
        diff = max(diff, float(np.max(np.abs(a - b), initial=0.0)))
        err2, ref2 = err2 + float(np.sum((a - b) ** 2)), ref2 + float(np.sum(b ** 2))
    out = {"max_abs_diff_vs_check": diff, "rel_err_vs_check": (err2 / ref2) ** 0.5 if ref2 else float(err2 > 0)}
    if overlaps:
        out["id_overlap_vs_check"] = float(np.mean(overlaps))
    return out


def _seconds_per_call(fn: Callable, arg_sets: list[tuple], reps: int, calls: int) -> float:
    """Seconds per call of `fn` (not jitted): with several input copies, one program runs it on each copy back to
    back (device time, no dispatch between the calls; distinct buffers, so nothing is computed once for all);
    with one, `calls` dispatches back to back (cases that large run far longer than a dispatch)."""
    if len(arg_sets) > 1:
        many = jax.jit(lambda sets: [fn(*a) for a in sets])
        return _median_seconds(many, (arg_sets,), reps, calls) / len(arg_sets)
    return _median_seconds(jax.jit(fn), arg_sets[0], reps, calls)


def measure(case: Case, reps: int, ceil: dict, calls: int, copies: int | None = None) -> dict:
    """One table row: the kernel checked against `case.check` on the device, then it and the XLA path timed."""
    checked = compare(jax.jit(case.kernel)(*case.args), jax.jit(case.check)(*case.args))
    arg_sets = _rotated(case.args, case.bytes, copies)
    t_k = _seconds_per_call(case.kernel, arg_sets, reps, calls)
    t_b = _seconds_per_call(case.baseline, arg_sets, reps, calls)
    predicted = max(case.bytes / H200_BYTES_PER_S, case.flops / H200_FLOPS)
    row = {"kernel": case.name, **checked, "pallas_s": t_k, "xla_s": t_b,
           "xla_over_pallas": t_b / t_k, "bytes": case.bytes, "flops": case.flops,
           "gb_per_s": case.bytes / t_k / 1e9, "tflop_per_s": case.flops / t_k / 1e12,
           "fraction_of_measured_bw": case.bytes / t_k / ceil["copy_bytes_per_s"],
           "predicted_h200_s": predicted, "input_copies": len(arg_sets)}
    for label, fn in case.others:  # seconds, or the error of an optional library (reported, not fatal)
        try:
            row.setdefault("others", {})[label] = _seconds_per_call(fn, arg_sets, reps, calls)
        except Exception as e:
            row.setdefault("others", {})[label] = f"{type(e).__name__}: {e}"[:500]
    return row


def run(smoke: bool, reps: int, seed: int, only: tuple[str, ...] = (), max_seconds: float | None = None,
        out: str | None = None) -> dict:
    """Every case (or those whose name contains one of `only`), each row printed and the report written to `out`
    as soon as it is measured, so a run cut short keeps what it measured. A case that fails (a kernel that does
    not compile, a wrong result is not a failure: its max difference is reported) is an `error` row; cases not
    started within `max_seconds`, or after a device fault (`DEVICE_FAULTS`), are `skipped` rows."""
    start, faulted = time.perf_counter(), None
    report = {"device": str(jax.devices()[0]), "backend": jax.default_backend(), "smoke": smoke, "seed": seed,
              "ceilings": ceilings(smoke, reps), "results": []}
    print_header(report)
    for name, build in cases(smoke, seed):
        if only and not any(s in name for s in only):
            continue
        if faulted:
            row = {"kernel": name, "skipped": f"the device faulted in {faulted}: its context is unusable"}
        elif max_seconds is not None and time.perf_counter() - start > max_seconds:
            row = {"kernel": name, "skipped": f"not started within --max-seconds {max_seconds:g}"}
        else:
            try:
                case = build()
            except Exception as e:
                row = {"kernel": name, "error": f"building it: {type(e).__name__}: {e}"[:2000]}
            else:
                try:
                    row = measure(case, reps, report["ceilings"], calls=1 if smoke else 10,
                                  copies=1 if smoke else None)
                except Exception as e:
                    row = {"kernel": case.name, "error": f"{type(e).__name__}: {e}"[:2000]}
                    if any(code in str(e) for code in DEVICE_FAULTS):
                        faulted = case.name
        report["results"].append(row)
        print_row(row, flush=True)
        if out:
            with open(out, "w") as f:
                json.dump(report, f, indent=1)
    return report


def print_header(report: dict) -> None:
    c = report["ceilings"]
    print(f"device {report['device']}  copy {c['copy_bytes_per_s'] / 1e9:.0f} GB/s  "
          f"matmul {c['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s")
    print(f"{'kernel':42s} {'pallas us':>10s} {'xla us':>10s} {'xla/pal':>8s} {'GB/s':>8s} {'%bw':>5s} "
          f"{'TFLOP/s':>8s} {'pred us':>8s} {'maxdiff':>9s} {'rel err':>9s} {'ids':>6s}")


def print_row(r: dict, flush: bool = False) -> None:
    if "pallas_s" not in r:
        print(f"{r['kernel']:42s} {r.get('error') or r.get('skipped')}"[:400], flush=flush)
        return
    print(f"{r['kernel']:42s} {r['pallas_s'] * 1e6:10.1f} {r['xla_s'] * 1e6:10.1f} {r['xla_over_pallas']:8.2f} "
          f"{r['gb_per_s']:8.1f} {100 * r['fraction_of_measured_bw']:5.1f} {r['tflop_per_s']:8.2f} "
          f"{r['predicted_h200_s'] * 1e6:8.1f} {r['max_abs_diff_vs_check']:9.2e} {r['rel_err_vs_check']:9.2e} "
          + (f"{r['id_overlap_vs_check']:6.3f}" if "id_overlap_vs_check" in r else f"{'':6s}"), flush=flush)
    for label, t in r.get("others", {}).items():
        print(f"  {r['kernel']}: {label} " + (f"{t * 1e6:.1f} us" if isinstance(t, float) else t), flush=flush)


def print_table(report: dict) -> None:
    print_header(report)
    for r in report["results"]:
        print_row(r)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, kernels interpreted (CPU)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default="", help="comma-separated parts of case names to run (default: all)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="start no case after this many seconds (the rest are reported as skipped)")
    p.add_argument("--out", default="pallas_kernels_bench.json")
    a = p.parse_args(argv)
    if not a.smoke and jax.default_backend() != "gpu":
        raise SystemExit("the full benchmark needs a GPU backend; use --smoke on CPU")
    only = tuple(x for x in a.only.split(",") if x)
    report = run(a.smoke, a.reps, a.seed, only, a.max_seconds, a.out)
    print("\nsummary (us per call, median of --reps; on a GPU, cases moving under 240 MB run on several input copies "
          "back to back in one program, larger ones as 10 calls dispatched back to back; ids: mean overlap of the "
          "selected id sets with the check's)")
    print_table(report)
    return report


if __name__ == "__main__":
    main()
