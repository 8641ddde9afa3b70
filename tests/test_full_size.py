"""Full-size models built abstractly (`eval_shape`, nothing allocated): shapes against the release
tensor inventory (spec §6.2) and the parameter counts `dsv41.info` reports (spec §1.3, §4.2)."""

import json
import subprocess
import sys

import jax.numpy as jnp
import pytest

from dsv41 import abstract_params
from dsv41.checkpoint import release_names
from dsv41.config import ModelConfig
from dsv41.info import info


@pytest.fixture(scope="module")
def flash():
    c = ModelConfig.preset("v41-flash")
    _, abstract = abstract_params(c, jnp.bfloat16, engram_fp8=True)
    return c, abstract


def test_v41_flash_inventory_shapes(flash):
    c, abstract = flash
    names = release_names(c, list(abstract))
    shape = lambda n: tuple(abstract[names[n].path].shape[1:] if names[n].expert is not None  # noqa: E731
                            else abstract[names[n].path].shape)
    want = {
        "layers.0.attn.wq_a.weight": (1280, 5120), "layers.0.attn.wq_b.weight": (32768, 1280),
        "layers.0.attn.wkv.weight": (512, 5120), "layers.0.attn.wo_a.weight": (8192, 4096),
        "layers.0.attn.wo_b.weight": (5120, 8192), "layers.0.attn.attn_sink": (64,),
        "layers.2.attn.compressor.wkv.weight": (512, 5120), "layers.2.attn.compressor.wgate.weight": (512, 5120),
        "layers.20.attn.compressor.norm.weight": (512,), "layers.20.attn.indexer.wk.weight": (128, 512),
        "layers.24.attn.indexer.wq_b.weight": (4096, 1280), "layers.24.attn.indexer.weights_proj.weight": (32, 5120),
        "layers.14.engram.embed.weight": (384016682, 256), "layers.14.engram.embed.scale": (384016682, 8),
        "layers.1.engram.wkv.weight": (25600, 6144), "layers.1.engram.q_weight": (4, 5120),
        "layers.39.ffn.gate.weight": (384, 5120), "layers.39.ffn.gate.bias": (384,),
        "layers.39.ffn.experts.383.w1.weight": (2304, 5120), "layers.39.ffn.experts.0.w2.weight": (5120, 2304),
        "layers.5.ffn.shared_experts.w2.weight": (5120, 2304), "layers.7.hc_attn_fn": (24, 20480),
        "mtp.0.main_proj.weight": (5120, 15360), "mtp.2.markov_head.embed.weight": (129280, 256),
        "mtp.2.confidence_head.proj.weight": (1, 5376), "mtp.1.ffn.experts.127.w3.weight": (2304, 5120),
        "embed.weight": (129280, 5120), "head.weight": (129280, 5120),
    }
    for n, s in want.items():
        assert shape(n) == s, n
    absent = ["layers.20.attn.compressor.wgate.weight", "layers.3.attn.compressor.wkv.weight",
              "layers.24.attn.indexer.wk.weight", "layers.21.attn.indexer.wq_b.weight", "hc_head_fn",
              "layers.0.ffn.gate.tid2eid", "layers.2.attn.compressor.ape", "mtp.0.attn.compressor.wkv.weight"]
    assert not set(absent) & set(names)
    assert abstract[names["layers.1.engram.embed.weight"].path].dtype == jnp.float8_e4m3fn


def test_info_cli_reports_spec_figures():
    out = subprocess.run([sys.executable, "-m", "dsv41.info", "v41-flash"], capture_output=True, text=True, check=True)
    d = json.loads(out.stdout)
    p = d["parameters"]
    assert round(p["backbone"] / 1e9, 1) == 551.9
    assert round(p["engram_tables"] / 1e9, 1) == 196.6
    assert round(p["active_per_decode_token"] / 1e9, 1) == 16.1
    assert round(p["active_per_prefill_token"] / 1e9, 1) == 7.9
    kv = d["kv_cache_bytes"]
    assert kv["global_kv_per_token"] == {"nvfp4+mxfp4": 890.0, "fp8+fp8": 1650.0, "bfloat16": 3200.0}
    assert kv["swa_per_request"]["fp8"] == 40 * 128 * 528
    assert [r["layer"] for r in d["roles"] if r["candidate_source"]] == [20] and d["ced_cut_layer"] == 20


def test_v4_flash_abstract_and_counts():
    c = ModelConfig.preset("v4-flash")
    d = info(c)
    assert 280e9 < d["parameters"]["backbone"] < 290e9  # V4-Flash is the 284B model
    _, abstract = abstract_params(c, jnp.bfloat16)
    names = release_names(c, list(abstract))
    assert tuple(abstract[names["layers.2.attn.compressor.ape"].path].shape) == (4, 1024)
    assert tuple(abstract[names["layers.3.attn.compressor.ape"].path].shape) == (128, 512)
    assert tuple(abstract[names["layers.0.ffn.gate.tid2eid"].path].shape) == (129280, 6)
    assert tuple(abstract[names["hc_head_fn"].path].shape) == (4, 16384)


def test_info_cli_bad_input():
    out = subprocess.run([sys.executable, "-m", "dsv41.info", "no-such-model"], capture_output=True, text=True)
    assert out.returncode == 2 and "neither a preset" in out.stderr
