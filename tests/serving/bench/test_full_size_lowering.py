"""The serving steps lowered on an abstract mesh (nothing allocated): the StableHLO collective counter, tiny's
DEP4 steps, and (with --full-size-lowering) tiny's steps compiled on a CPU device (the compile-time estimate's
path) and v41-flash's TP4 steps in the release formats."""

import pytest

from dsv41.config import load_config
from serving.bench.full_size_lowering import default_ladder, report
from serving.bench.hlo_text import stablehlo_collectives
from sharding.mesh import ParallelConfig

SHLO = """
module @jit_f {
  func.func public @main(%arg0: tensor<8x64xbf16>) -> (tensor<8x64xbf16>) {
    %0 = "stablehlo.all_to_all"(%arg0) <{split_count = 4 : i64}> : (tensor<8x64xbf16>) -> tensor<8x64xbf16>
    %1 = call @body(%0) : (tensor<8x64xbf16>) -> tensor<8x64xbf16>
    %2 = call @body(%1) : (tensor<8x64xbf16>) -> tensor<8x64xbf16>
    return %2 : tensor<8x64xbf16>
  }
  func.func private @body(%arg0: tensor<8x64xbf16>) -> (tensor<8x64xbf16>) {
    %0 = "stablehlo.all_reduce"(%arg0) <{channel_handle = #stablehlo.channel_handle<handle = 1, type = 1>}> ({
    ^bb0(%a: tensor<f32>, %b: tensor<f32>):
      %s = stablehlo.add %a, %b : tensor<f32>
      stablehlo.return %s : tensor<f32>
    }) : (tensor<2x16xf32>) -> tensor<2x16xf32>
    return %arg0 : tensor<8x64xbf16>
  }
}
"""


def test_stablehlo_collectives_counts_calls_and_regions():
    assert stablehlo_collectives(SHLO) == {"all_to_all": {"count": 1, "bytes": 8 * 64 * 2},
                                           "all_reduce": {"count": 2, "bytes": 2 * 2 * 16 * 4}}


def test_the_default_ladder_counts_programs_and_sums_the_compiled_steps():
    """v41-flash at 64 decode rows / 8,192 prefill tokens per rank: 11 token buckets, 12 kept-row buckets, 5 samplers;
    each bucket priced as the decode or the prefill step it is closest to (docs/design/memory-plan.md's figures)."""
    c = load_config("v41-flash")
    steps = {"decode": {"lower_s": 15.7, "compile_s": {"segment1": 61.2, "segment2": 73.9}},
             "prefill": {"lower_s": 24.0, "compile_s": {"segment1": 80.9, "segment2": 70.6}}}
    out = default_ladder(c, 64, 8192, steps)
    assert out["token_buckets"] == [1, 8, 16, 32, 64, 128, 512, 1024, 2048, 4096, 8192]
    assert out["kept_row_buckets"] == [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
    assert out["programs"] == 11 + 12 + 5
    decode_pair, prefill_1, prefill_2 = 61.2 + 73.9 + 15.7, 80.9 + 12.0, 70.6 + 12.0
    assert out["estimated_all_compiled_s_one_thread"] == round(5 * decode_pair + 6 * prefill_1 + 7 * prefill_2)
    assert "estimated_all_compiled_s_one_thread" not in default_ladder(c, 64, 8192, {"decode": {}, "prefill": {}})


def test_tiny_dep4_steps_lower_on_an_abstract_mesh():
    r = report("tiny", ParallelConfig(1, 4, True), weights="release", prefill_tokens=16, decode_batch=4)
    for step in r["steps"].values():  # 4 all-to-alls per MoE layer (tokens, weights, ids out; rows back)
        assert step["explicit_collectives"]["all_to_all"]["count"] == 4 * 8
        assert "all_reduce" not in step["explicit_collectives"]  # moe_tp = 1: no partial sums
    assert (r["steps"]["prefill"]["explicit_collective_bytes"] > r["steps"]["decode"]["explicit_collective_bytes"]
            > 0)


@pytest.mark.skipif("not config.getoption('--full-size-lowering')", reason="needs --full-size-lowering (~40 s)")
def test_tiny_steps_compile_on_cpu_devices():
    """`compile=True`: the steps lowered for this host's CPU devices and compiled, each segment timed (one device:
    the smallest program; a layout needs --num-cpu-devices of them, and says so)."""
    r = report("tiny", ParallelConfig(), weights="release", prefill_tokens=16, decode_batch=4, compile=True)
    assert r["platform"] == "cpu"
    for step in r["steps"].values():
        assert set(step["compile_s"]) == {"segment1", "segment2"} and all(s > 0 for s in step["compile_s"].values())
    with pytest.raises(ValueError, match="16 devices needed"):
        report("tiny", ParallelConfig(1, 16, True), prefill_tokens=16, decode_batch=4, compile=True)


@pytest.mark.skipif("not config.getoption('--full-size-lowering')", reason="needs --full-size-lowering (~45 s)")
def test_v41_flash_tp4_steps_lower():
    # measured 43 s on 2 busy cores (setup 6 s, decode 17 s, prefill 15 s), 0.6 GB resident
    r = report("v41-flash", ParallelConfig(4), prefill_tokens=8192, decode_batch=64)
    decode = r["steps"]["decode"]["explicit_collectives"]
    # TP4 without expert parallelism: the dispatch's all-to-alls are local, one partial-sum all-reduce over the
    # 4 expert-TP ranks per MoE layer (40), on the combined rows [64, 5120] float32 (not the capacity buffer)
    assert decode == {"all_reduce": {"count": 40, "bytes": 40 * 64 * 5120 * 4}}
