"""The report's HLO collective parser and its memory arithmetic (abstract shapes, no devices)."""

from sharding.mesh import ParallelConfig
from serving.bench.sharding_report import collective_bytes, memory_report

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


def test_memory_report_tp_vs_dep():
    tp = memory_report("small", ParallelConfig(4), dtype="float32", kv_format="auto", block_size=16)
    dep = memory_report("small", ParallelConfig(1, 8, True), dtype="float32", kv_format="auto", block_size=16)
    assert tp["param_bytes_total"] == dep["param_bytes_total"]
    # TP4 splits attention heads, vocab and every expert 4 ways; DEP8 splits only the experts (8 ways) and
    # replicates the rest, which in small (dense-heavy, unlike v41-flash) costs more per device than TP4
    assert tp["param_bytes_total"] / 4 <= tp["param_bytes_per_device"] < tp["param_bytes_total"] / 2
    assert dep["param_bytes_total"] / 8 < dep["param_bytes_per_device"] < dep["param_bytes_total"]
    assert (tp["kv_copies_per_token"], dep["kv_copies_per_token"]) == (4, 1)
    assert tp["kv_global_bytes_per_token"] == dep["kv_global_bytes_per_token"] > 0
