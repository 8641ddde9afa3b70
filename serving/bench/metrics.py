"""Benchmark metrics from per-request timelines (pure functions, NumPy only; spec §7.2-7.3).

vLLM `bench serve` definitions:
* TTFT = first streamed chunk - send. E2EL = last streamed chunk - send (vLLM's `latency`).
* TPOT = (last chunk - first chunk) / (completion_tokens - 1); requests with <= 1 token are left out.
* ITL = every gap between consecutive chunks, pooled over all requests (long requests weigh more).
* goodput = requests meeting every given SLO (TPOT of a 1-token request counts as 0) / duration.
* throughputs over the benchmark duration (first send -> last response end); total tokens = prompt
  (cached included) + completion tokens, from `usage`.
* peak output tok/s: tokens landed in 1-s buckets from the first send.
InferenceX: per-request ITL is one value per request, its mean gap per token, i.e. the same value as the
request's TPOT; interactivity at percentile p = 1 / (p-th percentile of per-request ITL), so P90
interactivity is the slow tail. Percentiles are NumPy's (linear interpolation), as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestRecord:
    """What the client saw of one request (perf_counter seconds)."""

    send_time: float
    end_time: float  # response fully read (or failed)
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk that carried choices
    prompt_tokens: int = 0  # usage.prompt_tokens (the dataset's length when usage has none)
    completion_tokens: int = 0  # usage.completion_tokens (the chunk count when usage has none)
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, None when not reported
    error: str | None = None  # "HTTP 503: message", or the exception; None when it succeeded
    session_id: str = ""
    turn: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)


def ttfts(records: list[RequestRecord]) -> list[float]:
    return [r.chunk_times[0] - r.send_time for r in records if r.ok]


def e2els(records: list[RequestRecord]) -> list[float]:
    return [r.chunk_times[-1] - r.send_time for r in records if r.ok]


def tpot(r: RequestRecord) -> float | None:
    """The request's mean time per output token after the first (= InferenceX's per-request ITL)."""
    if not r.ok or r.completion_tokens <= 1:
        return None
    return (r.chunk_times[-1] - r.chunk_times[0]) / (r.completion_tokens - 1)


def tpots(records: list[RequestRecord]) -> list[float]:
    return [t for t in map(tpot, records) if t is not None]


def pooled_itls(records: list[RequestRecord]) -> list[float]:
    """Every gap between consecutive chunks of every successful request (vLLM's ITL)."""
    return [g for r in records if r.ok for g in np.diff(r.chunk_times).tolist()]


def latency_stats(values_s: list[float], percentiles: list[float]) -> dict[str, float]:
    """mean / median / std / p<q> in milliseconds; zeros when there are no values (as vLLM)."""
    v = np.asarray(values_s if values_s else [0.0], dtype=np.float64) * 1000.0
    out = {"mean": float(v.mean()), "median": float(np.median(v)), "std": float(v.std())}
    for q in percentiles:
        out[f"p{q:g}"] = float(np.percentile(v, q))
    return out


def interactivity(per_request_itls_s: list[float], percentiles: list[float]) -> dict[str, float | None]:
    """Tokens/s/user: 1 / mean and 1 / p-th percentile of the per-request ITLs (InferenceX)."""
    if not per_request_itls_s:
        return {"mean": None, **{f"p{q:g}": None for q in percentiles}}
    v = np.asarray(per_request_itls_s, dtype=np.float64)
    out = {"mean": float(1.0 / v.mean())}
    for q in percentiles:
        out[f"p{q:g}"] = float(1.0 / np.percentile(v, q))
    return out


def duration(records: list[RequestRecord]) -> float:
    """First send to last response end, over every request (failed ones took time too)."""
    return max(r.end_time for r in records) - min(r.send_time for r in records)


def peak_output_tokens_per_s(records: list[RequestRecord], bucket_s: float = 1.0) -> float:
    """Most output tokens landing in one `bucket_s` bucket counted from the first send.

    Chunks carry no token counts, so a request's completion_tokens are spread evenly over its chunks
    (one token per chunk when the server streams token by token, as vLLM assumes)."""
    ok = [r for r in records if r.ok]
    if not ok:
        return 0.0
    t0 = min(r.send_time for r in records)
    buckets: dict[int, float] = {}
    for r in ok:
        per_chunk = r.completion_tokens / len(r.chunk_times)
        for t in r.chunk_times:
            b = int((t - t0) // bucket_s)
            buckets[b] = buckets.get(b, 0.0) + per_chunk
    return max(buckets.values()) / bucket_s


def prefix_hit_rate(records: list[RequestRecord]) -> float | None:
    """sum cached / sum prompt tokens over successful requests whose usage reported cached_tokens."""
    rep = [r for r in records if r.ok and r.cached_tokens is not None]
    prompt = sum(r.prompt_tokens for r in rep)
    return sum(r.cached_tokens for r in rep) / prompt if prompt else None


def error_kinds(records: list[RequestRecord]) -> dict[str, int]:
    """Failed requests counted by kind: the error text before its first ':' ("HTTP 503", "ReadTimeout",
    "stream error"), most frequent first."""
    kinds: dict[str, int] = {}
    for r in records:
        if not r.ok:
            kind = (r.error or "the stream carried no output chunk").split(":", 1)[0]
            kinds[kind] = kinds.get(kind, 0) + 1
    return dict(sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0])))


def window_token_throughput(records: list[RequestRecord], start: float, end: float) -> float | None:
    """(prompt + completion tokens) of the successful requests that ended in [start, end], per second of the
    window: throughput over a window where a given set of lanes were all running (None for an empty window)."""
    if end <= start:
        return None
    tokens = sum(r.prompt_tokens + r.completion_tokens for r in records if r.ok and start <= r.end_time <= end)
    return tokens / (end - start)


def good_requests(records: list[RequestRecord], slo_ms: dict[str, float]) -> int:
    """Successful requests meeting every SLO in {'ttft'|'tpot'|'e2el': ms} (DistServe goodput)."""
    unknown = set(slo_ms) - {"ttft", "tpot", "e2el"}
    if unknown:
        raise ValueError(f"unknown goodput metric(s) {sorted(unknown)}; use ttft, tpot, e2el")
    n = 0
    for r in records:
        if not r.ok:
            continue
        got = {"ttft": r.chunk_times[0] - r.send_time, "tpot": tpot(r) or 0.0,
               "e2el": r.chunk_times[-1] - r.send_time}
        n += all(got[k] * 1000.0 <= v for k, v in slo_ms.items())
    return n


def summarize(records: list[RequestRecord], percentiles: list[float],
              goodput_slo_ms: dict[str, float] | None = None) -> dict:
    """Every reported number, flat, with vLLM's JSON names where vLLM has the metric."""
    if not records:
        raise ValueError("no requests to summarize")
    ok = [r for r in records if r.ok]
    dur = duration(records)
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.completion_tokens for r in ok)
    out = {
        "completed": len(ok), "failed": len(records) - len(ok), "duration": dur,
        "total_input_tokens": prompt, "total_output_tokens": output,
        "total_cached_tokens": sum(r.cached_tokens or 0 for r in ok),
        "request_throughput": len(ok) / dur, "output_throughput": output / dur,
        "total_token_throughput": (prompt + output) / dur,
        "max_output_tokens_per_s": peak_output_tokens_per_s(records),
        "prefix_hit_rate": prefix_hit_rate(records),
        "cached_tokens_reported": sum(1 for r in ok if r.cached_tokens is not None),
    }
    if goodput_slo_ms:
        out["request_goodput"] = good_requests(records, goodput_slo_ms) / dur
    per_request_itl = tpots(records)
    for name, values in (("ttft", ttfts(records)), ("tpot", per_request_itl), ("itl", pooled_itls(records)),
                         ("e2el", e2els(records))):
        for stat, v in latency_stats(values, percentiles).items():
            out[f"{stat}_{name}_ms"] = v
    for stat, v in interactivity(per_request_itl, sorted({50.0, 90.0, *percentiles})).items():
        out[f"{stat}_interactivity_tok_s"] = v
    return out
