"""The report's HLO collective parser, its memory arithmetic (abstract shapes, no devices), the full-size
release-format bytes against the spec's tensor inventory, and the plan's verdicts."""

import math
from dataclasses import replace

import pytest

from dsv41.config import load_config
from serving.bench import memory_plan
from serving.bench.hlo_text import collective_bytes, merged
from serving.bench.layout_memory import engram_staging_bytes, memory_report
from sharding.mesh import ParallelConfig

HLO = """
  %all-to-all = (f32[1,1,2,64]{3,2,1,0}, /*index=1*/f32[1,1,2,64]{3,2,1,0}) all-to-all(%a, %b), replica_groups={}
  %all-reduce.3 = bf16[4,8]{1,0} all-reduce(%x), to_apply=%add
  %rs = f32[2,8]{1,0} reduce-scatter(%x), dimensions={0}
  %not = f32[4,8]{1,0} add(%x, %y)
"""


def test_collective_bytes_from_hlo_text():
    got = collective_bytes(HLO)
    assert got == {"all-to-all": {"count": 1, "bytes": 2 * 2 * 64 * 4}, "all-reduce": {"count": 1, "bytes": 64},
                   "reduce-scatter": {"count": 1, "bytes": 64}}
    both = merged([got, {"all-reduce": {"count": 2, "bytes": 8}, "all-gather": {"count": 1, "bytes": 4}}])
    assert both == {**got, "all-reduce": {"count": 3, "bytes": 72}, "all-gather": {"count": 1, "bytes": 4}}


def test_memory_report_tp_vs_dep():
    kw = {"weights": "dequantized", "dtype": "float32", "kv_format": "auto", "block_size": 16}
    tp = memory_report("small", ParallelConfig(4), **kw)
    dep = memory_report("small", ParallelConfig(1, 8, True), **kw)
    assert tp["param_bytes_total"] == dep["param_bytes_total"]
    # TP4 splits attention heads, vocab and every expert 4 ways; DEP8 splits only the experts (8 ways) and
    # replicates the rest, which in small (dense-heavy, unlike v41-flash) costs more per device than TP4
    assert tp["param_bytes_total"] / 4 <= tp["param_bytes_per_device"] < tp["param_bytes_total"] / 2
    assert dep["param_bytes_total"] / 8 < dep["param_bytes_per_device"] < dep["param_bytes_total"]
    assert (tp["kv_copies_per_token"], dep["kv_copies_per_token"]) == (4, 1)
    assert tp["kv_global_bytes_per_token"] == dep["kv_global_bytes_per_token"] > 0
    release = memory_report("small", ParallelConfig(4), **{**kw, "weights": "release"})
    assert release["param_bytes_per_device"] < tp["param_bytes_per_device"] / 2  # FP8 / MXFP4 vs float32


def test_kv_bytes_per_device_tp_replicates_dp_splits():
    kw = {"max_model_len": 131072, "num_requests": 64}
    tp = memory_report("v41-flash", ParallelConfig(4), **kw)
    dep = memory_report("v41-flash", ParallelConfig(1, 8, True), **kw)
    # spec §4.2: 890 B/token of global KV; §4.3: 40 x 128 x 528 B of SWA per request (+ 3 ratio-2 tails)
    per_request = 131072 * 890 + 40 * 128 * 528 + 3 * 2 * 512 * 4
    assert tp["kv_bytes_per_request"] == dep["kv_bytes_per_request"] == per_request
    assert tp["kv_bytes_per_device"] == 64 * per_request  # every tp rank holds all 64 requests
    assert dep["kv_bytes_per_device"] == 8 * per_request  # each of 8 dp ranks holds 8


def _fp8(out: int, inp: int) -> int:
    """An FP8 linear of the release: e4m3 [out, in] + one UE8M0 byte per 32 x 32 block."""
    return out * inp + math.ceil(out / 32) * math.ceil(inp / 32)


def spec_inventory_bytes() -> tuple[int, int]:
    """(bytes of everything but the Engram tables, bytes of the two tables) of DeepSeek-V4.1-Flash, written out
    from the tensor inventory of architecture-v41.md §6.2 (shapes, dtypes, presence), not from the model code."""
    D, H, d, q, G, o, I, E, V = 5120, 64, 512, 1280, 8, 1024, 2304, 384, 129280
    BF16, F32 = 2, 4

    def block(n_experts: int) -> int:
        attn = (_fp8(q, D) + q * BF16 + _fp8(H * d, q) + _fp8(d, D) + d * BF16 + _fp8(G * o, H * d // G)
                + _fp8(D, G * o) + H * F32)
        expert = 2 * (I * D // 2 + I * D // 32) + (D * I // 2 + D * I // 32)  # MXFP4 w1, w3 [I, D]; w2 [D, I]
        ffn = (n_experts * D * BF16 + 2 * n_experts * F32 + n_experts * expert
               + 2 * _fp8(I, D) + _fp8(D, I))
        hc = 2 * (24 * 4 * D * F32 + 24 * F32 + 3 * F32)
        return 2 * D * BF16 + attn + ffn + hc

    kv_sources, ratio2_sources, index_sources, engram_layers = 4, 3, 8, 2
    total = 40 * block(E) + 3 * block(128)  # layers.0-39 and mtp.0-2
    total += kv_sources * (d * D * BF16 + d * BF16 + 128 * d * BF16 + 128 * BF16)  # compressor wkv, norm; wk, k_norm
    total += ratio2_sources * d * D * BF16  # compressor wgate
    total += index_sources * (_fp8(32 * 128, q) + 32 * D * BF16)  # indexer wq_b, weights_proj
    total += engram_layers * (_fp8(5 * D, 24 * 256) + 2 * 4 * D * BF16)  # engram wkv, q_weight, k_weight
    total += 2 * V * D * BF16 + D * BF16  # embed, head, norm
    total += _fp8(D, 3 * D) + 2 * D * BF16 + 2 * V * 256 * BF16 + (D + 256) * BF16  # DSpark heads
    tables = (384006168 + 384016682) * (256 + 8)
    return total, tables


def test_v41_flash_release_bytes_match_the_spec_inventory():
    r = memory_report("v41-flash", ParallelConfig())
    spec_rest, spec_tables = spec_inventory_bytes()
    assert r["engram_table_bytes_per_host"] == spec_tables
    assert abs(r["param_bytes_total"] - spec_rest) / spec_rest < 0.01
    # the release's 48 shards hold 510,286,023,000 bytes (spec §6), vision tower and bias_vl included
    ours = r["param_bytes_total"] + r["engram_table_bytes_per_host"]
    assert 0.99 * 510_286_023_000 < ours <= 510_286_023_000


def test_engram_staging_formula():
    c = load_config("v41-flash")
    assert engram_staging_bytes(c, 8192) == 2 * 8192 * 2 * (3 * 8) * (256 + 8)
    assert engram_staging_bytes(load_config("v4-flash"), 8192) == 0


@pytest.fixture(scope="module")
def release_plan():
    return {r["layout"]: r for r in memory_plan.plan("v41-flash")}


def test_plan_verdicts_are_consistent(release_plan):
    p = release_plan
    assert set(p) == {"TP4 GB300", "TP4 H200", "DEP8 H200", "DEP4 GB300"}
    for r in p.values():
        assert r["weights_fit"] and r["max_requests"]["1M"] <= r["max_requests"]["128K"]
        dp = int(r["parallel"].split("dp=")[1].split()[0])
        for k, n in r["max_requests"].items():  # the largest count: n fits, one more per rank does not
            per_rank = n // dp
            assert per_rank * r["kv_bytes_per_request"][k] <= r["free_for_kv_bytes_per_device"]
            assert (per_rank + 1) * r["kv_bytes_per_request"][k] > r["free_for_kv_bytes_per_device"]
    # same layout, less memory: fewer requests; DEP spreads the requests over dp ranks: more than TP4
    for k in memory_plan.LENGTHS:
        assert 0 < p["TP4 H200"]["max_requests"][k] < p["TP4 GB300"]["max_requests"][k]
        assert p["TP4 H200"]["max_requests"][k] < p["DEP8 H200"]["max_requests"][k]
    assert p["DEP8 H200"]["weights_bytes_per_device"] < p["TP4 H200"]["weights_bytes_per_device"]


def test_plan_monotone_in_memory_and_refuses_what_does_not_fit():
    h200 = memory_plan.TARGETS[1]
    counts = [memory_plan.plan_row("v41-flash", replace(h200, memory_bytes=int(gb * 1e9)))["max_requests"]["1M"]
              for gb in (80, 100, 141, 200)]
    assert counts == sorted(counts) and counts[0] == 0 < counts[-1]
    rows = {r["layout"]: r for r in memory_plan.plan("v41-flash", weights="dequantized")}
    assert not rows["TP4 H200"]["weights_fit"]  # 285 GB of bf16 weights per device
    assert rows["TP4 GB300"]["weights_fit"] and rows["TP4 GB300"]["max_requests"]["128K"] == 0
    assert "does not fit" in memory_plan.markdown(list(rows.values()), 0.1)
