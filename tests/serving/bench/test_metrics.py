"""Benchmark metric functions on a hand-built timeline; expected values computed by hand below."""

import numpy as np
import pytest

from serving.bench import metrics
from serving.bench.metrics import RequestRecord


def _timeline() -> list[RequestRecord]:
    # A: 5 tokens, one per chunk, 0.1 s apart.  B: 2 tokens 1 s apart.  C: 1 token.  D: failed.
    return [
        RequestRecord(0.0, 1.0, [0.5, 0.6, 0.7, 0.8, 0.9], prompt_tokens=100, completion_tokens=5, cached_tokens=50),
        RequestRecord(0.0, 2.1, [1.0, 2.0], prompt_tokens=100, completion_tokens=2, cached_tokens=0),
        RequestRecord(1.0, 1.6, [1.5], prompt_tokens=50, completion_tokens=1, cached_tokens=None),
        RequestRecord(0.2, 3.0, [], prompt_tokens=70, error="HTTP 503: waiting queue is full"),
    ]


def test_summary_matches_hand_computed_values():
    s = metrics.summarize(_timeline(), [50, 90, 99])
    assert (s["completed"], s["failed"]) == (3, 1)
    assert s["duration"] == pytest.approx(3.0)  # first send 0.0 -> last end 3.0 (the failed request)
    # TTFT 0.5, 1.0, 0.5 s
    assert s["mean_ttft_ms"] == pytest.approx(2000 / 3)
    assert s["median_ttft_ms"] == pytest.approx(500)
    # TPOT: A (0.9-0.5)/4 = 0.1, B (2-1)/1 = 1.0; C has one token and is left out
    assert s["mean_tpot_ms"] == pytest.approx(550)
    assert s["p90_tpot_ms"] == pytest.approx(100 + 0.9 * 900)
    # pooled ITL: A's four 0.1 s gaps and B's 1.0 s gap -> mean 1.4 / 5, median 0.1
    assert s["mean_itl_ms"] == pytest.approx(280)
    assert s["median_itl_ms"] == pytest.approx(100)
    # E2EL = last chunk - send: 0.9, 2.0, 0.5
    assert s["mean_e2el_ms"] == pytest.approx(3400 / 3)
    # throughput counts prompt tokens including the cached ones: (250 + 8) / 3 s
    assert s["total_input_tokens"] == 250 and s["total_output_tokens"] == 8
    assert s["total_token_throughput"] == pytest.approx(258 / 3)
    assert s["output_throughput"] == pytest.approx(8 / 3)
    assert s["request_throughput"] == pytest.approx(1.0)
    # hit rate over requests that reported cached_tokens (A, B): 50 / 200
    assert s["prefix_hit_rate"] == pytest.approx(0.25)
    assert s["total_cached_tokens"] == 50 and s["cached_tokens_reported"] == 2
    # 1-s buckets from t=0: A's 5 tokens in [0,1), B's first + C's in [1,2), B's last in [2,3)
    assert s["max_output_tokens_per_s"] == pytest.approx(5)
    # interactivity = 1 / percentile of the per-request ITLs [0.1, 1.0] s
    assert s["p90_interactivity_tok_s"] == pytest.approx(1 / 0.91)
    assert s["p50_interactivity_tok_s"] == pytest.approx(1 / 0.55)
    assert s["mean_interactivity_tok_s"] == pytest.approx(1 / 0.55)


def test_pooled_itl_differs_from_per_request_itl():
    recs = _timeline()
    pooled = metrics.pooled_itls(recs)
    per_request = metrics.tpots(recs)
    assert len(pooled) == 5 and len(per_request) == 2
    assert np.mean(pooled) == pytest.approx(0.28)  # the long request A dominates the pooled gaps
    assert np.mean(per_request) == pytest.approx(0.55)  # one value per request


def test_tpot_spreads_multi_token_chunks_and_excludes_one_token_requests():
    # 9 tokens in 3 chunks (e.g. speculative decoding): per token (2.0 - 1.0) / 8, not per chunk
    r = RequestRecord(0.0, 2.0, [1.0, 1.5, 2.0], completion_tokens=9)
    assert metrics.tpot(r) == pytest.approx(0.125)
    assert metrics.tpot(RequestRecord(0.0, 1.0, [0.5], completion_tokens=1)) is None
    assert metrics.tpot(RequestRecord(0.0, 1.0, [], completion_tokens=3, error="HTTP 400: bad")) is None
    # peak buckets spread the 9 tokens evenly over the 3 chunks: [1, 2) holds 2 chunks = 6 tokens
    assert metrics.peak_output_tokens_per_s([r]) == pytest.approx(6)


def test_percentiles_match_numpy():
    rng = np.random.default_rng(0)
    values = rng.exponential(0.05, size=101).tolist()
    stats = metrics.latency_stats(values, [50, 90, 99, 99.9])
    v = np.asarray(values) * 1000
    for q in (50, 90, 99, 99.9):
        assert stats[f"p{q:g}"] == pytest.approx(np.percentile(v, q))
    assert stats["mean"] == pytest.approx(v.mean()) and stats["std"] == pytest.approx(v.std())
    assert metrics.latency_stats([0.001, 0.002, 0.003, 0.004], [90])["p90"] == pytest.approx(3.7)


def test_goodput_counts_requests_meeting_every_slo():
    recs = _timeline()
    assert metrics.good_requests(recs, {"ttft": 600}) == 2  # A and C (B's TTFT is 1000 ms)
    assert metrics.good_requests(recs, {"ttft": 600, "tpot": 50}) == 1  # A's TPOT is 100 ms; C counts as 0
    assert metrics.good_requests(recs, {"e2el": 5000}) == 3  # the failed request never counts
    with pytest.raises(ValueError, match="unknown goodput metric"):
        metrics.good_requests(recs, {"itl": 10})


def test_no_cached_tokens_reported_gives_no_hit_rate():
    recs = [RequestRecord(0.0, 1.0, [0.5], prompt_tokens=10, completion_tokens=1)]
    assert metrics.prefix_hit_rate(recs) is None
    assert metrics.summarize(recs, [99])["prefix_hit_rate"] is None
