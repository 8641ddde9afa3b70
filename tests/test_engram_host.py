"""Engram tables in host memory (`dsv41.engram_host`): the same logits as device-resident tables through the exact
forward and the serving runtime, no table bytes on the device, one shared mapping of the checkpoint's bytes,
and the table-order gather equal to the plain one."""

import gc

import jax
import numpy as np
import pytest

import dsv41
from dsv41.engram_host import HostEngramTables
from dsv41.safetensors_io import open_checkpoint
from serving.runtime.config import RuntimeConfig
from serving.runtime.runner import Runner
from tests.release_checkpoint import write_release
from tests.serving.driver import Driver


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_release(tmp_path_factory.mktemp("tiny_engram"), "tiny", seed=4)


def test_host_tables_give_the_logits_of_device_tables(tiny_dir):
    ids = np.arange(50) * 11 % 512
    device = dsv41.load(tiny_dir)
    host = dsv41.load(tiny_dir, engram_cpu_offload=True)
    np.testing.assert_array_equal(host.logits(ids), device.logits(ids))
    np.testing.assert_array_equal(device.with_engram_on_host().logits(ids), device.logits(ids))


@pytest.mark.slow
def test_runtime_with_host_tables_matches_device_tables(tiny_dir):
    rc = RuntimeConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=128, block_size=8,
                       token_buckets=(8, 32))
    prompts = {"a": [int(t) for t in np.random.default_rng(1).integers(3, 512, 45)],
               "b": [int(t) for t in np.random.default_rng(2).integers(3, 512, 9)]}
    outs = []
    for offload in (False, True):
        runner = Runner(dsv41.load(tiny_dir, engram_cpu_offload=offload), rc, progress=False)
        runner.compiler.precompile()
        d = Driver(runner)
        for rid, p in prompts.items():
            d.start(rid, p)
        got = [d.step({"a": 32}), d.step({"a": 13, "b": 9})]  # chunked prefill, two requests batched
        for _ in range(3):
            for rid in prompts:
                d.append(rid, int(np.argmax(got[-1][rid])))  # both in the last step's output
            got.append(d.step({"a": 1, "b": 1}))
        outs.append(np.stack([s[r] for s in got for r in sorted(s)]))
    np.testing.assert_array_equal(outs[1], outs[0])


def test_device_holds_no_table_bytes_and_loads_share_one_mapping(tiny_dir):
    gc.collect()
    before = {id(a) for a in jax.live_arrays()}
    host = dsv41.load(tiny_dir, engram_cpu_offload=True)
    host.logits(np.arange(20))
    gc.collect()
    new = [a for a in jax.live_arrays() if id(a) not in before]
    assert sorted(map(id, new)) == sorted(id(a) for a in host.params.values())  # parameters only
    tables = host.engram_tables
    assert not any(p[2:4] == ("engram", "embed") for p in host.params)
    device = dsv41.load(tiny_dir)
    table_bytes = sum(a.nbytes for p, a in device.params.items() if p[2:4] == ("engram", "embed"))
    assert host.device_bytes() == device.device_bytes() - table_bytes and tables.nbytes == table_bytes
    # the tables are the checkpoint's bytes, mapped (no copy), and a second load - another data-parallel
    # replica in this process - reads the very same mapping
    entries = open_checkpoint(tiny_dir)
    first = entries[f"layers.{host.config.engram_layer_ids[0]}.engram.embed.weight"]
    assert isinstance(tables.values[0], np.memmap) and str(tables.values[0].filename) == str(first.file.resolve())
    assert tables.values[0].offset == first.offset
    again = dsv41.load(tiny_dir, engram_cpu_offload=True).engram_tables
    assert all(a is b for a, b in zip(again.values + again.scales, tables.values + tables.scales))


def test_table_order_gather_equals_the_plain_gather():
    rng = np.random.default_rng(0)
    values = [rng.integers(0, 256, (1000, 64), dtype=np.uint8) for _ in range(2)]
    scales = [rng.integers(100, 140, (1000, 2), dtype=np.uint8) for _ in range(2)]
    ids = rng.integers(0, 1000, (3, 40, 2, 6))
    plain = HostEngramTables(values, scales, sort_threshold=10**9).gather(ids)
    ordered = HostEngramTables(values, scales, sort_threshold=1).gather(ids)
    for got in (plain, ordered):
        np.testing.assert_array_equal(got.values[..., 1, :, :], values[1][ids[..., 1, :]])
        np.testing.assert_array_equal(got.scales[..., 0, :, :], scales[0][ids[..., 0, :]])
    np.testing.assert_array_equal(ordered.values, plain.values)
    valid = np.array([True, False, True])  # a bucket's padding rows are not gathered: zeros
    masked = HostEngramTables(values, scales).gather(ids, valid)
    np.testing.assert_array_equal(masked.values[valid], plain.values[valid])
    assert not masked.values[~valid].any() and not masked.scales[~valid].any()


def test_unquantized_tables_cannot_live_on_the_host(tmp_path):
    m = dsv41.random_model("tiny", seed=4)
    with pytest.raises(ValueError, match="not FP8"):
        m.with_engram_on_host()
    write_release(tmp_path, m, quantize=False)
    with pytest.raises(dsv41.CheckpointError, match="must be F8_E4M3 to stay in host memory"):
        dsv41.load(tmp_path, engram_cpu_offload=True)
