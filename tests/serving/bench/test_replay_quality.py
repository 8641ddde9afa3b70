"""The replay-quality study's machinery on the tiny preset: exact mode reproduces the model's full-sequence
log-probabilities, an exact-halo prefix hit reproduces exact mode, the bounded modes differ, and the summary
and JSON hold what the table in docs/benchmarks/replay-quality.md quotes."""

import json

import numpy as np
import pytest
from scipy.special import log_softmax

import dsv41
from serving.bench import replay_quality as rq

pytestmark = pytest.mark.slow  # the second tier (`make test-slow`; tests/README.md)

L, S = 96, 16  # tiny: window 8, 8 layers; an exact-halo hit must exceed 8 * 7 = 56 tokens


@pytest.fixture(scope="module")
def study():
    model = dsv41.random_model("tiny", seed=0)
    return model, rq.ReplayStudy(model, max_modes=5, max_len=L, continuation=S, chunk=128, block_size=16,
                                 progress=False)


@pytest.fixture(scope="module")
def passages(study):
    model, _ = study
    return np.random.default_rng(1).integers(3, model.config.vocab_size, (3, L))


def test_hit_lengths_are_block_aligned_and_adopted():
    assert rq.hit_lengths(960, (0.25, 0.5, 0.75), 64, 128) == [192, 448, 704]
    assert rq.hit_lengths(200, (0.25, 0.5), 64, 128) == []  # 50 and 100 are within one window: not adopted
    names = [m.name for m in rq.study_modes(960, (0.5,), 64, 128)]
    assert names == ["exact", "decoder", "encoder@448", "both@448"]


def test_modes_against_the_exact_forward(study, passages):
    model, st = study
    modes = [rq.Mode("exact", False), rq.Mode("decoder", True), rq.Mode("encoder@32", False, 32),
             rq.Mode("both@32", True, 32), rq.Mode("exact-halo@64", False, 64, bounded_hit=False)]
    results = [st.run_passage(ids, modes) for ids in passages]
    for ids, r in zip(passages, results):
        logits = model.logits(ids).astype(np.float64)
        logp = log_softmax(logits, axis=-1)
        want = logp[np.arange(L - S - 1, L - 1), ids[L - S:]]  # row p predicts token p + 1
        np.testing.assert_allclose(r.logprobs["exact"], want, atol=1e-4)
        np.testing.assert_allclose(r.logprobs["exact-halo@64"], r.logprobs["exact"], atol=1e-4)
        assert r.greedy["exact"][0] == logits[L - S - 1].argmax()
        for m in ("decoder", "encoder@32", "both@32"):
            assert np.isfinite(r.logprobs[m]).all()
            assert np.abs(r.logprobs[m] - r.logprobs["exact"]).max() > 1e-5, m  # bounded replay is approximate
    rows = {row["mode"]: row for row in rq.summarize(results)}
    assert rows["exact"]["delta_nll"] == 0 and rows["exact"]["greedy_agreement"] == 1.0
    assert rows["exact"]["greedy_identical_prefix"] == S
    assert abs(rows["exact-halo@64"]["delta_nll"]) < 1e-4
    nll = np.mean([-r.logprobs["decoder"].mean() for r in results])
    assert rows["decoder"]["nll"] == pytest.approx(nll)


def test_run_study_json_and_table(study, passages, tmp_path):
    model, st = study
    result = rq.run_study(model, {L: passages}, continuation=S, fractions=(0.5,), chunk=128, block_size=16,
                          unigram=lambda ids: np.full(len(ids), np.log(model.config.vocab_size)), progress=False,
                          study=st)
    rows = result["tables"][L]
    assert [r["mode"] for r in rows] == ["exact", "decoder", "encoder@32", "both@32", "unigram"]
    assert rows[-1]["ppl"] == pytest.approx(model.config.vocab_size)
    for r in rows[:-1]:
        assert {"nll", "nll_se", "delta_nll", "delta_se", "delta_in_exact_se", "within_1p5_se",
                "greedy_agreement"} <= set(r)
    json.loads(json.dumps(result))
    with pytest.raises(ValueError, match="does not fit"):
        rq.run_study(model, {2 * L: passages}, continuation=S, chunk=128, block_size=16, study=st)
    table = rq.markdown(result["tables"], S, result["passages"])
    assert "both@32" in table and "unigram" in table
