"""The runtime's MoE small-step autotuner.

On the XLA path (CPU) a step of few rows per expert (`pallas_kernels.moe_xla.is_small_step`: decode steps) can
run the routed experts in any of `moe_xla.SMALL_STEP_FORMS`, and which is fastest is the CPU's (`moe_xla.xla`).
`RuntimeConfig.moe_small_steps="tune"` (the default) times them here - eagerly, before a bucket that runs such a step
is traced (`serving.runtime.compiler.StepCompiler.kernels_for`), keeping only forms that give the rule's (batched,
weights right) bits, so the choice never moves a result. The choices go into the bucket's `KernelConfig`
(`moe_small_steps`), whose static value the traced program reads, and into a JSON file beside the executable
cache (`ExecutableCacheSettings.tuning_file`), so a restart on the same machine and versions times nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import tempfile
import time
import warnings
from pathlib import Path
from typing import Iterable

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from pallas_kernels import moe_xla, tile_table
from pallas_kernels.dispatch import resolve_impl
from pallas_kernels.kernel_config import KernelConfig, MoeStep
from pallas_kernels.moe_xla import SMALL_STEP_FORMS

ROUNDS = 7  # timed runs of each form (after one warm-up run); the median decides


def runtime_kernels(rc) -> tuple[KernelConfig, bool]:
    """A runner's kernels from its `RuntimeConfig` (`kernel_impl`, `kernel_tiles`: a device's tile table where the
    Pallas path runs; `moe_small_steps`), and whether its buckets' small steps are tuned: with "tune", on the XLA
    path (the one that reads the forms); else every small step takes the rule or the one form named."""
    fixed = "rule" if rc.moe_small_steps == "tune" else rc.moe_small_steps
    tuned = (tile_table.for_runtime(rc.kernel_tiles, jax.devices()[0].device_kind)
             if resolve_impl(rc.kernel_impl) == "pallas" else ())
    return (KernelConfig(rc.kernel_impl, moe_small_step_form=fixed, tuned=tuned),
            rc.moe_small_steps == "tune" and resolve_impl(rc.kernel_impl) == "xla")


def bucket_kernels(base: KernelConfig, module, *, rows=(), draft_rows=(), tuned: dict[MoeStep, str],
                   tuning_file: Path | None = None) -> KernelConfig:
    """`base` with the forms of the small steps a program runs (`small_steps(module, rows, draft_rows)`), from
    `tuned` (the forms known so far, which this extends) or else tuned now (`tune_small_steps`)."""
    steps = small_steps(module, rows, draft_rows)
    if not steps:
        return base
    tuned.update(tune_small_steps([s for s in steps if s not in tuned], tuning_file))
    return dataclasses.replace(base, moe_small_steps={s: tuned[s] for s in steps})


def small_steps(module, rows: Iterable[int], draft_rows: Iterable[int] = ()) -> list[MoeStep]:
    """The small steps of the float routed experts a runner's programs run themselves (not through an installed
    expert dispatch, `MoE.routed_compute`): the backbone's MoE layers on each of `rows` (segment 1's token buckets,
    segment 2's kept-row buckets) and the drafter's (`module.dspark`) on each of `draft_rows` (the speculative
    step's block pass: its request buckets x the block size)."""
    groups = [(module.layers, tuple(rows))]
    if getattr(module, "dspark", None) is not None:
        groups.append((module.dspark.blocks, tuple(draft_rows)))
    out = set()
    for blocks, counts in groups:
        for block in blocks:
            moe = block.ffn
            if moe.routed_compute is not None:
                continue
            for T in counts:
                step = moe.experts.small_step(T, moe.gate.top_k)
                if step is not None and moe_xla.is_small_step(T * step.top_k, step.n_experts, step.inter, step.dim):
                    out.add(step)
    return sorted(out)


def stored(steps: Iterable[MoeStep], tuning_file: Path | None) -> bool:
    """Whether `tune_small_steps` would find every step's form in `tuning_file` (and time none)."""
    forms = _read(Path(tuning_file) if tuning_file else None)
    return all(forms.get(_key(step)) in SMALL_STEP_FORMS for step in steps)


def tune_small_steps(steps: Iterable[MoeStep], tuning_file: Path | None = None) -> tuple[tuple[MoeStep, str], ...]:
    """((step, form), ...): each step's form read from `tuning_file` (a JSON file; None: none) or else timed
    (`fastest_form`, once per process) and stored there. Runs eagerly: refused inside a trace."""
    if isinstance(jnp.zeros(()), jax.core.Tracer):
        raise RuntimeError("tune_small_steps times programs: call it before tracing, not inside a trace")
    path = Path(tuning_file) if tuning_file else None
    out = []
    for step in steps:
        key = _key(step)
        form = _read(path).get(key)
        if form not in SMALL_STEP_FORMS:
            form = fastest_form(step)
            if path is not None:
                _write(path, {**_read(path), key: form})
        out.append((step, form))
    return tuple(out)


@functools.cache
def fastest_form(step: MoeStep) -> str:
    """The fastest form on this machine for `step` (float experts, a uniform random routing) among SMALL_STEP_FORMS
    that give the rule's (batched, weights right) bits here on random inputs, so the choice never moves a result:
    each compiled alone, then ROUNDS rounds of one run of each, medians."""
    T, k, E, I, D, dtype = step
    kx, kw, k1, k3, k2 = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(kx, (T, D), dtype)
    ids = jnp.argsort(jax.random.uniform(kw, (T, E)), axis=1)[:, :k].astype(jnp.int32)
    w = jnp.full((T, k), 1.0 / k, jnp.float32)
    w1, w3 = (jax.random.normal(kk, (E, I, D), dtype) / D ** 0.5 for kk in (k1, k3))
    w2 = jax.random.normal(k2, (E, D, I), dtype) / I ** 0.5
    args = (x, ids, w, w1, w3, w2)
    runs = {form: jax.jit(functools.partial(moe_xla.xla, limit=10.0, small_steps=form)) for form in SMALL_STEP_FORMS}
    outs = {form: jax.device_get(run(*args)) for form, run in runs.items()}  # also each form's warm-up
    runs = {form: run for form, run in runs.items() if np.array_equal(outs[form], outs["batched_right"])}
    seconds: dict[str, list[float]] = {form: [] for form in runs}
    for _ in range(ROUNDS):
        for form, run in runs.items():
            t = time.perf_counter()
            run(*args).block_until_ready()
            seconds[form].append(time.perf_counter() - t)
    return min(seconds, key=lambda form: float(np.median(seconds[form])))


def _key(step: MoeStep) -> str:
    """A step's key in the tuning file: its shape and what the timing depends on (versions, device, CPU)."""
    return repr((*step, jax.__version__, jaxlib.__version__, jax.devices()[0].device_kind, platform.machine(),
                 _cpu_model()))


def _read(path: Path | None) -> dict:
    try:
        return json.loads(path.read_text()) if path is not None else {}
    except (OSError, ValueError):  # absent or torn: tune again
        return {}


def _write(path: Path, stored: dict) -> None:
    """Replace the file atomically; a folder that cannot be written warns and keeps nothing."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            tmp = f.name
            json.dump(stored, f, indent=0)
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        warnings.warn(f"MoE small-step tuning file {path}: not written ({e})", stacklevel=3)


@functools.cache
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        return ""
