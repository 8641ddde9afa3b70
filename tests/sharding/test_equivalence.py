"""The sharded layouts give the single-device logits (prefill through ShardedModel.logits, decode through the
runtime's cache on the mesh, and several requests on different data-parallel ranks in the same steps), on 8
virtual CPU devices in a subprocess (this process may have initialised jax with another device count). tiny is
loaded from a quantized release checkpoint, its weights kept in FP8 / MXFP4; small (dense) covers float weights.

Budget: the suite runs tiny's four layouts for prefill, TP4 / DEP8 through the runtime, per-rank batches on
dp4 x ep2 / DEP8, and small's DEP dp=2 x ep=4 prefill (`test_equivalence_small.py`, a file of its own so
that pytest-xdist can run it beside this one); the rest:
`python -m tests.sharding.equivalence_worker --preset small --decode-layouts all --dp-batches dep4x2,dep8x8`.
Expert parallelism alone (DEP8) is bit-exact; layouts with tp > 1 are within float32 noise."""

import pytest

from tests.sharding.equivalence_worker import run as _worker

pytestmark = pytest.mark.slow  # the second tier (`make test-slow`; tests/README.md)

TOL = 1e-5


@pytest.fixture(scope="module")
def tiny():
    return _worker("--preset", "tiny", "--release", "--layouts", "tp4,dep2x4,dep4x2,dep8x8", "--decode-layouts",
                   "tp4,dep8x8", "--dp-batches", "dep4x2,dep8x8", "--eplb", "--dispatch-reference")


def test_release_formats_are_split_not_copied(tiny):
    """tiny is loaded from a quantized release checkpoint (FP8 linears, MXFP4 experts kept as stored). On every
    layout each device holds exactly its shard of each such tensor; under DEP8 the experts stay MXFP4 and one
    device holds a fraction of the bytes; an expert-TP split below one 32-channel block (tiny's 32-wide
    intermediate over moe_tp = 4 or 2) decodes those experts instead, and says so."""
    for layout in ("tp4", "dep2x4", "dep4x2", "dep8x8"):
        assert tiny[layout]["shard_bytes"]["each_device_holds_its_shard"], tiny[layout]
    dep = tiny["dep8x8"]
    assert dep["decoded_experts"] == [] and dep["shard_bytes"]["max_device_bytes"] < 0.7 * dep["shard_bytes"][
        "unsharded_bytes"], dep
    assert "layers.*.ffn.experts" in tiny["tp4"]["decoded_experts"], tiny["tp4"]


def test_one_device_dispatch_is_bitwise(tiny):
    """The expert dispatch on a one-device mesh runs each (token, choice) through the model's own grouped
    matmul, so the logits are the single-device model's exactly (not merely within float32 noise)."""
    assert tiny["reference"]["dispatch_vs_dense_max_abs_err"] == 0.0, tiny["reference"]


@pytest.mark.parametrize("layout", ["tp4", "dep2x4", "dep4x2", "dep8x8"])
def test_tiny_prefill(tiny, layout):
    assert tiny[layout]["prefill_max_abs_err"] <= TOL, tiny[layout]


@pytest.mark.parametrize("layout", ["tp4", "dep8x8"])
def test_tiny_decode_with_runtime_cache(tiny, layout):
    r = tiny[layout]
    assert r["decode_max_abs_err"] <= TOL, r
    assert ("dp_ep" in r["cache_spec"]) == layout.startswith("dep")  # KV per dp rank vs replicated under TP


def test_expert_parallel_alone_is_bitwise(tiny):
    """DEP8 (no tensor parallelism): the prefill equals the single-device model and the runtime's steps equal
    the single-device runtime's, bit for bit."""
    r = tiny["dep8x8"]
    assert r["prefill_max_abs_err"] == 0.0 and r["decode_vs_one_device_runtime"] == 0.0, r


@pytest.mark.parametrize("layout", ["dep4x2", "dep8x8"])
def test_tiny_requests_on_different_dp_ranks(tiny, layout):
    """Per-rank batches: three requests (two on the last rank) prefilled and decoded in shared steps each get
    their single-device logits, and the KV cache was written only in the requests' own (rank, slot) pairs.
    dep4x2 splits the experts' intermediate dimension over two dp ranks (the token gather path)."""
    r = tiny[layout]["dp_batches"]
    assert max(r["max_abs_err"].values()) <= TOL, r
    assert r["kv_written_rank_slot"] == r["requests_rank_slot"] and r["ranks"] == int(layout[3]), r


def test_eplb_placements_keep_logits(tiny):
    """Experts replicated into redundant slots (16 physical for 8 logical on 8 ranks), then migrated to a
    second placement between calls: the same logits, one compilation."""
    e = tiny["eplb"]
    assert e["physical_experts"] == 16 and e["compiles"] == 1, e
    assert max(e["max_abs_err_per_placement"]) <= TOL, e
