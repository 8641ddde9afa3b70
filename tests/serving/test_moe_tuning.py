"""The runtime's MoE small-step autotuner (`serving.runtime.moe_tuning`): it times the forms eagerly, picks only forms
giving the rule's bits, keeps its picks in the tuning file and reads them back without timing; a runner tunes every
small step of a bucket just before that bucket is traced (never while), and compiles exactly the tuned forms."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import dsv41
from pallas_kernels import moe_xla
from pallas_kernels.expert_weights import QuantizedExperts
from pallas_kernels.kernel_config import KernelConfig, MoeStep
from pallas_kernels.moe_xla import SMALL_STEP_FORMS
from serving.runtime import moe_tuning
from serving.runtime.config import RuntimeConfig
from serving.runtime.runner import Runner

# a small step (too many pairs for the per-pair form, 8 rows per expert) whose real forms take ~1 ms
STEP = MoeStep(32, 2, 16, 128, 256, "float32")


@pytest.fixture
def fresh_timings():
    """No timing of this process remembered, before the test and after it (its fakes' choices dropped)."""
    timed = moe_tuning.fastest_form
    timed.cache_clear()
    yield
    timed.cache_clear()


def no_timing(step):
    pytest.fail(f"{step} was timed")


def test_step_is_small():
    assert moe_xla.is_small_step(STEP.rows * STEP.top_k, STEP.n_experts, STEP.inter, STEP.dim)


def test_tuned_form_is_timed_once_kept_and_read_back(tmp_path, monkeypatch, fresh_timings):
    """The pick is timed, stored under the step's shape (and the machine's versions), and read back from the file
    by a process that has not timed it (its cache cleared) without timing; a torn file is timed again; a form the
    file plants is taken as it is. `stored` says which steps the file holds (the background compiler looks up only
    those programs in the executable cache, timing nothing)."""
    path = tmp_path / "tuning" / "moe_small_steps.json"
    assert not moe_tuning.stored([STEP], path) and moe_tuning.stored([], path)
    ((step, form),) = moe_tuning.tune_small_steps([STEP], path)
    other = STEP._replace(rows=64)
    assert moe_tuning.stored([STEP], path) and not moe_tuning.stored([STEP, other], path)
    assert step == STEP and form in SMALL_STEP_FORMS
    stored = json.loads(path.read_text())
    assert list(stored.values()) == [form] and next(iter(stored)).startswith("(32, 2, 16, 128, 256, 'float32', ")
    moe_tuning.fastest_form.cache_clear()
    with monkeypatch.context() as m:
        m.setattr(moe_tuning, "fastest_form", no_timing)
        assert moe_tuning.tune_small_steps([STEP], path) == ((STEP, form),)
        for planted in SMALL_STEP_FORMS:
            path.write_text(json.dumps({k: planted for k in stored}))
            assert moe_tuning.tune_small_steps([STEP], path) == ((STEP, planted),)
    path.write_text("{torn")
    timed = []
    monkeypatch.setattr(moe_tuning, "fastest_form", lambda s: timed.append(s) or "tiles")
    assert moe_tuning.tune_small_steps([STEP], path) == ((STEP, "tiles"),) and timed == [STEP]
    assert list(json.loads(path.read_text()).values()) == ["tiles"]


def test_only_forms_giving_the_rules_bits_compete(monkeypatch, fresh_timings):
    """A form whose bits differ from the rule's is never picked, even the fastest by far (here: a constant)."""
    real = moe_xla.xla

    def xla(x, ids, w, w1, w3, w2, *, small_steps="rule", **kw):
        if small_steps == "tiles":  # the cheapest program there is, with other bits than the rule's
            return jnp.ones((x.shape[0], x.shape[1]), jnp.float32)
        return real(x, ids, w, w1, w3, w2, small_steps=small_steps, **kw)

    monkeypatch.setattr(moe_xla, "xla", xla)
    assert moe_tuning.fastest_form(STEP) in ("batched_left", "batched_right")
    moe_tuning.fastest_form.cache_clear()

    def xla_same_bits(x, ids, w, w1, w3, w2, *, small_steps="rule", **kw):  # tiles: the rule's own program
        return real(x, ids, w, w1, w3, w2, small_steps="batched_right" if small_steps == "tiles" else small_steps,
                    **kw)

    monkeypatch.setattr(moe_xla, "xla", xla_same_bits)
    assert moe_tuning.fastest_form(STEP) in SMALL_STEP_FORMS  # tiles competes again


def test_no_timing_inside_a_trace():
    with pytest.raises(RuntimeError, match="not inside a trace"):
        jax.jit(lambda x: moe_tuning.tune_small_steps([STEP]) and x)(1.0)


def test_bucket_kernels_follow_the_runtime_config(monkeypatch):
    """"rule" or a form for every small step as it is; "tune" only on the XLA path (the one that reads it), a
    program's kernels then holding the forms of the small steps it runs, each tuned once."""
    module = dsv41.random_model("tiny").module
    monkeypatch.setattr(moe_xla, "GATHER_BYTES", 0)
    timed = []
    monkeypatch.setattr(moe_tuning, "fastest_form", lambda s: timed.append(s) or "tiles")
    for choice in ("rule", *SMALL_STEP_FORMS):
        assert moe_tuning.runtime_kernels(RuntimeConfig(moe_small_steps=choice)) == (
            KernelConfig("auto", moe_small_step_form=choice), False)
    assert moe_tuning.runtime_kernels(RuntimeConfig(kernel_impl="reference")) == (KernelConfig("reference"), False)
    base, tune = moe_tuning.runtime_kernels(RuntimeConfig(kernel_impl="xla"))
    assert base == KernelConfig("xla") and tune
    tuned = {}
    step = MoeStep(4, 2, 8, 32, 64, "float32")  # the tiny model's MoE on 4 rows
    kernels = moe_tuning.bucket_kernels(base, module, rows=(4,), tuned=tuned)
    assert kernels == KernelConfig("xla", moe_small_steps={step: "tiles"}) and tuned == {step: "tiles"}
    assert kernels.describe() == "xla; MoE small steps (top-2 of 8 experts 32x64 float32: 4 rows tiles; others rule)"
    assert moe_tuning.bucket_kernels(base, module, rows=(4,), tuned=tuned) == kernels and timed == [step]


def test_each_bucket_is_tuned_before_it_is_traced_and_compiles_the_tuned_forms(monkeypatch):
    """A speculative runner (backbone steps of its token buckets, drafter steps of requests x block) times nothing when
    it is built; each bucket's small steps are timed before that bucket is traced, never while it is, and each
    small-step call in its program takes the form tuned for its shape. The runner's model is left as it was."""
    model = dsv41.random_model("tiny")
    monkeypatch.setattr(moe_xla, "GATHER_BYTES", 0)  # the tiny model's steps are small steps, not per pair
    timed, tracing = [], []

    def fastest(s):
        assert not tracing, f"{s} timed while a program was traced"
        timed.append(s)
        return SMALL_STEP_FORMS[(s.rows // 3 + s.n_experts) % 3]

    monkeypatch.setattr(moe_tuning, "fastest_form", fastest)
    rc = RuntimeConfig(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64, block_size=8, token_buckets=(8,),
                       swa_bounded_replay=False, speculative_config='{"method": "dspark"}')
    runner = Runner(model, rc, progress=False)
    assert timed == []
    real, calls = moe_xla.xla, []

    def spy(x, ids, w, w1, w3, w2, *, small_steps="rule", **kw):
        tracing.append(1)
        if not isinstance(w1, QuantizedExperts) and moe_xla.is_small_step(ids.size, *w1.shape[:2], x.shape[1]):
            calls.append((MoeStep(x.shape[0], ids.shape[1], *w1.shape, jnp.dtype(w1.dtype).name), small_steps))
        out = real(x, ids, w, w1, w3, w2, small_steps=small_steps, **kw)
        tracing.pop()
        return out

    monkeypatch.setattr(moe_xla, "xla", spy)
    runner.compiler.precompile()
    c = model.config
    table = runner.compiler.tuned
    backbone = {MoeStep(T, c.num_experts_per_tok, c.n_routed_experts, c.moe_intermediate_size, c.hidden_size,
                        "float32") for T in (8,)}
    drafter = {MoeStep(R * c.dspark_block_size, c.dspark_num_experts_per_tok, c.dspark_n_routed_experts,
                       c.moe_intermediate_size, c.hidden_size, "float32") for R in (1, 2)}
    assert set(table) == backbone | drafter and sorted(timed) == sorted(table)
    assert len(set(table.values())) > 1  # the forms differ between steps: a mix-up shows
    assert calls and all(table.get(step) == form for step, form in calls), calls
    assert {step for step, _ in calls} == set(table)
    assert all(m.kernels == KernelConfig() for _, m in nnx.iter_modules(model.module) if hasattr(m, "kernels"))
