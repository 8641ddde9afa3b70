"""Loading straight onto a mesh (`dsv41.load(..., shardings=)`): each device receives only its shard of each
tensor from the mapped files, host memory stays near one tensor above what the devices hold, the sharded model
computes the same logits, and a bad tensor still names itself."""

import json

import ml_dtypes
import numpy as np
import pytest

import dsv41
from dsv41.safetensors_io import CheckpointError, open_checkpoint, write_checkpoint
from serving.bench.load_memory import (
    run_measure,
    synthetic_config,
    write_synthetic_checkpoint,
)
from sharding.mesh import ParallelConfig, make_mesh
from sharding.model import ShardedModel
from sharding.rules import param_sharding_fn, param_shardings
from tests.release_checkpoint import write_release


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_release(tmp_path_factory.mktemp("tiny_sharded"), "tiny", seed=6)


def test_loading_onto_the_mesh_places_each_shard_and_keeps_the_logits(tiny_dir):
    pc = ParallelConfig(1, 8, True)  # DEP8: experts split over the 8 devices
    mesh = make_mesh(pc)
    model = dsv41.load(tiny_dir, shardings=param_sharding_fn(mesh), engram_cpu_offload=True)
    want = param_shardings(mesh, {p: a.shape for p, a in model.params.items()})
    for p, a in model.params.items():
        assert a.sharding.is_equivalent_to(want[p], a.ndim), p
        for shard in a.addressable_shards:  # each device: exactly its index range
            assert shard.data.shape == np.empty(a.shape, np.uint8)[shard.index].shape, p
    w1 = model.params[("layers", 2, "ffn", "experts", "w1")]
    assert w1.dtype == np.uint8 and {s.data.shape[0] for s in w1.addressable_shards} == {w1.shape[0] // 8}
    sharded = ShardedModel(model, pc)
    assert all(sharded.params[p] is a for p, a in model.params.items())  # already in place: not copied again
    ids = np.arange(30) * 5 % 512
    np.testing.assert_allclose(sharded.logits(ids), dsv41.load(tiny_dir, engram_cpu_offload=True).logits(ids),
                               rtol=0, atol=1e-5)


def test_a_bad_tensor_still_names_itself_when_loading_shards(tiny_dir, tmp_path):
    tensors = {n: np.asarray(e.read()) for n, e in open_checkpoint(tiny_dir).items()}
    e8m0 = {n for n, e in open_checkpoint(tiny_dir).items() if e.dtype == "F8_E8M0"}
    tensors["layers.3.attn.wq_a.weight"] = np.zeros((31, 64), ml_dtypes.float8_e4m3fn)
    write_checkpoint(tmp_path, tensors, e8m0)
    (tmp_path / "config.json").write_text((tiny_dir / "config.json").read_text())
    mesh = make_mesh(ParallelConfig(1, 8, True))
    with pytest.raises(CheckpointError, match=r"tensor layers.3.attn.wq_a.weight has shape \[31, 64\]"):
        dsv41.load(tmp_path, shardings=param_sharding_fn(mesh))


def test_host_memory_while_loading_stays_near_one_tensor(tmp_path):
    """A synthetic release checkpoint (small with 32 x 512 MXFP4 experts, ~0.3 GB) loaded in a fresh process onto
    DEP8: anonymous memory at its peak exceeds what the devices hold at the end by less than 1.5 x the largest
    tensor read at a time (`python -m serving.bench.load_memory` does the same at several GB)."""
    written = write_synthetic_checkpoint(tmp_path, synthetic_config(32, 512))
    r = run_measure(tmp_path, "dep8", "bfloat16")
    print("\n" + json.dumps(r))
    assert written > 2e8 and r["each_device_holds_its_shard"], r
    assert r["peak_overhead"] < 1.5 * r["largest_tensor_loaded"], r
    assert r["param_bytes_held_by_devices"] <= r["final_anon_above_baseline"] * 1.1, r  # the devices' bytes are real
