"""The full-size memory plan: for each target layout, weights and Engram staging per device, the memory left
for KV after a fixed reserve, and how many long requests that KV holds.

    python -m serving.bench.sharding_report --plan [--weights release] [--reserve-fraction 0.1] [--out plan.json]

Rules (stated in the table's footer too):
  device memory   the vendor's figure in decimal GB (GB300 288 GB, H200 141 GB); the usable figure a driver
                  reports is about that (H200: 143,771 MiB = 150.8 GB), so the plan errs on the small side
  reserve         `reserve_fraction` of device memory for activations, XLA workspace and fragmentation (a
                  fixed share, not computed from the step buckets)
  free for KV     device - weights - Engram staging - reserve
  requests        per dp rank floor(free / KV of one request at that length), times dp: under TP the single
                  latent is replicated over tp, so the tp ranks of a dp rank hold the same requests
A layout whose weights alone exceed the device "does not fit"; 0 requests means the weights fit but not one
request of that length does.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv41.config import load_config
from serving.bench.layout_memory import kv_bytes_per_request, memory_report
from serving.runtime.kv_cache import CacheLayout
from sharding.mesh import ParallelConfig

GB = 1e9
LENGTHS = {"128K": 131072, "1M": 1048576}


@dataclass(frozen=True)
class Target:
    """A layout on one kind of accelerator."""

    name: str
    device: str
    memory_bytes: int  # per device
    parallel: ParallelConfig


TARGETS = (
    Target("TP4", "GB300", int(288 * GB), ParallelConfig(tensor_parallel_size=4)),
    Target("TP4", "H200", int(141 * GB), ParallelConfig(tensor_parallel_size=4)),
    Target("DEP8", "H200", int(141 * GB), ParallelConfig(data_parallel_size=8, enable_expert_parallel=True)),
    Target("DEP4", "GB300", int(288 * GB), ParallelConfig(data_parallel_size=4, enable_expert_parallel=True)),
)


def plan_row(preset: str, t: Target, *, weights: str = "release", reserve_fraction: float = 0.10,
             max_num_batched_tokens: int = 8192, kv_format: str = "release", block_size: int = 256) -> dict:
    """One target's line of the plan (bytes, and the largest request counts per length)."""
    r = memory_report(preset, t.parallel, weights=weights, kv_format=kv_format, block_size=block_size,
                      max_num_batched_tokens=max_num_batched_tokens)
    weights_b, staging = r["param_bytes_per_device"], r["engram_staging_bytes_per_device"]
    reserve = int(reserve_fraction * t.memory_bytes)
    free = t.memory_bytes - weights_b - staging - reserve
    dp = t.parallel.data_parallel_size
    c = load_config(preset)
    layout = CacheLayout(c, 1, block_size, 1, kv_format, "bfloat16")
    per_request = {k: kv_bytes_per_request(layout, n) for k, n in LENGTHS.items() if n <= c.max_position_embeddings}
    return {"layout": f"{t.name} {t.device}", "parallel": t.parallel.describe(), "devices": t.parallel.world_size,
            "device_memory_bytes": t.memory_bytes, "weights": weights,
            "weights_bytes_per_device": weights_b, "engram_staging_bytes_per_device": staging,
            "reserve_bytes_per_device": reserve, "free_for_kv_bytes_per_device": max(free, 0),
            "weights_fit": weights_b <= t.memory_bytes, "kv_bytes_per_request": per_request,
            "max_requests": {k: (dp * max(free, 0) // b) for k, b in per_request.items()},
            "engram_table_bytes_per_host": r["engram_table_bytes_per_host"],
            "replicated_fallbacks": r["replicated_fallbacks"]}


def plan(preset: str = "v41-flash", targets=TARGETS, **kw) -> list[dict]:
    return [plan_row(preset, t, **kw) for t in targets]


def markdown(rows: list[dict], reserve_fraction: float) -> str:
    """The plan as a Markdown table (GB = 1e9 bytes) with the rules in a footer."""
    g = lambda b: f"{b / GB:.1f}"
    head = ("| layout | devices | GB / device | weights / device | Engram staging | reserve | free for KV "
            "| 128K requests | 1M requests |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        counts = [str(r["max_requests"].get(k, "-")) if r["weights_fit"] else "does not fit" for k in LENGTHS]
        lines.append(f"| {r['layout']} | {r['devices']} | {g(r['device_memory_bytes'])} "
                     f"| {g(r['weights_bytes_per_device'])} | {r['engram_staging_bytes_per_device'] / GB:.2f} "
                     f"| {g(r['reserve_bytes_per_device'])} | {g(r['free_for_kv_bytes_per_device'])} "
                     f"| {' | '.join(counts)} |")
    r0 = rows[0]
    per_req = ", ".join(f"{k} {b / 1e6:.1f} MB" for k, b in r0["kv_bytes_per_request"].items())
    lines.append("")
    lines.append(f"Weights: {r0['weights']}; Engram tables {g(r0['engram_table_bytes_per_host'])} GB in host "
                 f"memory (one copy per host); staging at max_num_batched_tokens per dp rank; reserve = "
                 f"{reserve_fraction:.0%} of device memory (activations, workspace); KV per request "
                 f"(release records, SWA + tails included): {per_req}; requests = dp x floor(free / KV per request).")
    return "\n".join(lines)
