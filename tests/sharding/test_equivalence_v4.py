"""V4-Flash on a mesh: the tiny V4 oracle config (SWA with hash routing, CSA ratio 4, HCA ratio 128, hc_head)
under DEP2x4 - tensor-parallel attention over 4 devices, experts split over 4 expert-parallel ranks, 2
data-parallel ranks - against the single-device model: prefill through ShardedModel.logits, a runtime session
on the mesh (prefill chunk, then decode steps with the cache), and three requests on both dp ranks in shared
steps (a file of its own so pytest-xdist runs it beside the V4.1 layouts). TP4 and DEP8 alone measured
prefill 4.5e-6 / 5.7e-6, decode 4.3e-6 / 2.7e-6 (DEP8 decode bitwise equal to the one-device runtime):
`python -m tests.sharding.equivalence_worker --preset tests/fixtures/oracle/v4_tiny/config.json --layouts
tp4,dep8x8 --decode-layouts tp4,dep8x8`."""

from tests.sharding.equivalence_worker import run
from tests.sharding.test_equivalence import TOL

CONFIG = "tests/fixtures/oracle/v4_tiny/config.json"


def test_v4_dep2x4_prefill_decode_and_dp_batches():
    out = run("--preset", CONFIG, "--layouts", "dep2x4", "--decode-layouts", "dep2x4", "--dp-batches", "dep2x4")
    r = out["dep2x4"]
    assert r["prefill_max_abs_err"] <= TOL and r["decode_max_abs_err"] <= TOL, r
    assert "dp_ep" in r["cache_spec"] and r["replicated_fallbacks"] == [], r  # KV per dp rank, nothing replicated
    dp = r["dp_batches"]
    assert max(dp["max_abs_err"].values()) <= TOL and dp["ranks"] == 2, dp
    assert dp["kv_written_rank_slot"] == dp["requests_rank_slot"], dp
