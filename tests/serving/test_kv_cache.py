"""KV-cache layout: bytes per token from the (abstract) allocation against spec §4.2, budget sizing."""

import pytest

from dsv41.config import ModelConfig
from serving.runtime.kv_cache import CacheLayout, plan_layout, smallest_block_size


def test_full_config_release_records_match_spec():
    c = ModelConfig.preset("v41-flash")
    rep = CacheLayout(c, num_blocks=16, block_size=64, num_slots=2, fmt="release").report()
    assert rep["global_bytes_per_token"] == 890.0  # 2.5 rows/token x (288 NVFP4 + 68 MXFP4)
    tails = 3 * 2 * 512 * 4  # ratio-2 sources 2, 8, 14: one open [kv, gate] fp32 row each
    assert rep["swa_and_tail_bytes_per_request"] == 40 * 128 * 528 + tails
    bf16 = CacheLayout(c, num_blocks=16, block_size=64, num_slots=2, fmt="auto", dtype="bfloat16").report()
    assert bf16["global_bytes_per_token"] == 2.5 * (1024 + 256) == 3200.0


def test_layout_shapes_per_group():
    c = ModelConfig.preset("tiny")
    sh = CacheLayout(c, num_blocks=5, block_size=8, num_slots=3).shapes()
    assert sorted(sh.rows) == [2, 4] and sorted(sh.keys) == [2, 4] and sorted(sh.tail) == [2]
    assert sh.rows[2].shape == (5, 4, 32) and sh.rows[4].shape == (5, 8, 32) and sh.keys[4].shape == (5, 8, 16)
    assert len(sh.swa) == 8 and sh.swa[7].shape == (3, 8, 32)


def test_budget_sizing_and_errors():
    c = ModelConfig.preset("tiny")
    probe = CacheLayout(c, 1, 8, 4)
    budget = probe.bytes_per_slot() * 4 + probe.bytes_per_block() * 100 + 5
    assert plan_layout(c, memory_bytes=budget, block_size=8, num_slots=4, max_model_len=256).num_blocks == 100
    with pytest.raises(ValueError, match="one request of max_model_len 4096 needs 512"):
        plan_layout(c, memory_bytes=budget, block_size=8, num_slots=4, max_model_len=4096)
    with pytest.raises(ValueError, match="whole ratio-2 rows"):
        CacheLayout(c, 1, 7, 1)
    with pytest.raises(ValueError, match="kv cache format"):
        CacheLayout(c, 1, 8, 1, fmt="int4")


@pytest.mark.parametrize("preset", ["tiny", "small", "v41-flash"])
@pytest.mark.parametrize("at_least", [1, 8, 20])
def test_smallest_block_size_is_the_least_accepted(preset, at_least):
    c = ModelConfig.preset(preset)
    b = smallest_block_size(c, at_least)
    CacheLayout(c, 1, b, 1)  # accepted
    for smaller in range(at_least, b):
        with pytest.raises(ValueError, match="block_size"):
            CacheLayout(c, 1, smaller, 1)
