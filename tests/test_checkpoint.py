"""Release checkpoint layout: write -> read round trips, the tensor inventory, and errors that name tensors."""

import json

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

import dsv41
from dsv41 import quant
from dsv41.checkpoint import export_tensors, save_checkpoint
from dsv41.safetensors_io import CheckpointError, open_checkpoint, write_checkpoint


@pytest.fixture(scope="module")
def tiny():
    return dsv41.random_model("tiny", seed=3)


@pytest.fixture(scope="module")
def quantized_dir(tiny, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_q")
    params = {p: np.asarray(v) for p, v in tiny.params.items()}
    save_checkpoint(folder, tiny.config, params, quantize=True, shard_bytes=300_000)
    return folder


def test_quantized_tiny_inventory_matches_spec(quantized_dir):
    entries = open_checkpoint(quantized_dir)
    assert (quantized_dir / "model.safetensors.index.json").exists()  # sharded
    assert len(entries) == 709  # spec §6.4: the tiny synthetic release checkpoint has 709 tensors
    want = {"layers.2.attn.wq_b.weight": ("F8_E4M3", (128, 32)), "layers.2.attn.wq_b.scale": ("F8_E8M0", (4, 1)),
            "layers.2.ffn.experts.0.w1.weight": ("I8", (32, 32)), "layers.2.ffn.experts.0.w1.scale": ("F8_E8M0", (32, 2)),
            "layers.1.engram.embed.weight": ("F8_E4M3", (434, 32)), "layers.1.engram.embed.scale": ("F8_E8M0", (434, 1)),
            "layers.0.hc_attn_fn": ("F32", (24, 256)), "layers.3.attn_norm.weight": ("BF16", (64,)),
            "layers.4.attn.compressor.wkv.weight": ("BF16", (32, 64)), "mtp.0.main_proj.weight": ("F8_E4M3", (64, 192))}
    for name, (dtype, shape) in want.items():
        assert (entries[name].dtype, entries[name].shape) == (dtype, shape), name
    assert "layers.4.attn.compressor.wgate.weight" not in entries  # ratio-1 source: no gate
    assert "layers.6.attn.indexer.wk.weight" not in entries  # index source that is not a KV source
    assert "layers.6.attn.indexer.wq_b.weight" in entries and "layers.3.attn.indexer.wq_b.weight" not in entries


def _fp8_requantized_bytes_match(name, entries, again):
    """Identical bytes, except tiles whose dequantized max is exactly 224 * scale: the ceil-exponent rule
    then picks a scale one step smaller (the spec's "identical bytes" misses this); values stay identical."""
    q0, s0 = np.asarray(entries[name].read()), np.asarray(entries[name[:-7] + ".scale"].read())
    q1, s1 = again[name], again[name[:-7] + ".scale"]
    block = (1, 32) if "engram.embed" in name else (32, 32)
    d0, d1 = quant.dequantize_fp8_blocks(q0, s0, block), quant.dequantize_fp8_blocks(q1, s1, block)
    np.testing.assert_array_equal(d0, d1)
    for i, j in zip(*np.nonzero(s0 != s1)):
        tile = d0[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
        assert s1[i, j] == s0[i, j] - 1 and np.abs(tile).max() == 224 * 2.0 ** (int(s0[i, j]) - 127), name
    same = np.repeat(np.repeat(s0 == s1, block[0], 0), block[1], 1)[: q0.shape[0], : q0.shape[1]]
    assert q0.view(np.uint8)[same].tobytes() == q1.view(np.uint8)[same].tobytes(), name
    return int((s0 != s1).sum())


def test_round_trip_is_exact(quantized_dir, tiny, tmp_path):
    m1 = dsv41.load(quantized_dir)
    again, _ = export_tensors(m1.config, {p: np.asarray(v) for p, v in m1.params.items()}, quantize=True)
    entries = open_checkpoint(quantized_dir)
    assert set(again) == set(entries)
    for name, e in entries.items():
        if e.dtype == "I8":  # MXFP4: compared on dequantized values (spec §6.3b)
            scale = name[:-7] + ".scale"
            np.testing.assert_array_equal(quant.dequantize_mxfp4(again[name], again[scale]),
                                          quant.dequantize_mxfp4(np.asarray(e.read()), np.asarray(entries[scale].read())))
        elif e.dtype == "F8_E4M3":
            _fp8_requantized_bytes_match(name, entries, again)
        elif not name.endswith(".scale"):
            assert again[name].tobytes() == np.asarray(e.read()).tobytes(), name
    # Unquantized write of the loaded parameters reads back identical.
    save_checkpoint(tmp_path, m1.config, {p: np.asarray(v) for p, v in m1.params.items()}, quantize=False)
    m2 = dsv41.load(tmp_path)
    for p, v in m1.params.items():
        assert v.dtype == m2.params[p].dtype and np.array_equal(np.asarray(v), np.asarray(m2.params[p])), p
    ids = np.arange(26) * 7 % 512
    np.testing.assert_array_equal(m1.logits(ids), m2.logits(ids))


def test_our_files_read_by_safetensors(tmp_path):
    t = {"a.weight": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.array([1, 2], np.int32)}
    write_checkpoint(tmp_path, t)
    back = safetensors.numpy.load_file(str(tmp_path / "model.safetensors"))
    assert set(back) == set(t) and all(np.array_equal(back[k], t[k]) for k in t)


def _rewrite(src, dst, edit):
    tensors = {n: np.asarray(e.read()) for n, e in open_checkpoint(src).items()}
    e8m0 = {n for n, e in open_checkpoint(src).items() if e.dtype == "F8_E8M0"}
    edit(tensors)
    write_checkpoint(dst, tensors, e8m0 & set(tensors))
    (dst / "config.json").write_text((src / "config.json").read_text())


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.__setitem__("layers.3.attn.mystery.weight", np.zeros(2, np.float32)),
     "unknown tensor layers.3.attn.mystery.weight"),
    (lambda t: t.pop("layers.5.hc_ffn_base"), "missing tensor layers.5.hc_ffn_base"),
    (lambda t: t.pop("layers.2.attn.wq_b.scale"), "layers.2.attn.wq_b.weight is F8_E4M3 but the checkpoint has no "
                                                   "layers.2.attn.wq_b.scale"),
    (lambda t: t.__setitem__("norm.weight", np.zeros(65, ml_dtypes.bfloat16)),
     "tensor norm.weight has shape [65], the config needs [64]"),
    (lambda t: t.pop("layers.4.ffn.experts.7.w2.weight"), "missing tensor layers.4.ffn.experts.7.w2.weight"),
])
def test_bad_checkpoint_names_the_tensor(quantized_dir, tmp_path, edit, message):
    _rewrite(quantized_dir, tmp_path, edit)
    with pytest.raises(CheckpointError) as e:
        dsv41.load(tmp_path)
    assert message in str(e.value), str(e.value)


def test_vision_and_text_only_extras_are_skipped(quantized_dir, tmp_path, tiny):
    def add(t):
        t["vision.blocks.0.attn.qkv.weight"] = np.zeros((4, 4), ml_dtypes.bfloat16)
        t["image_newline"] = np.zeros(64, ml_dtypes.bfloat16)
        t["layers.0.ffn.gate.bias_vl"] = np.zeros(8, np.float32)
    _rewrite(quantized_dir, tmp_path, add)
    ids = np.arange(20)
    np.testing.assert_array_equal(dsv41.load(tmp_path).logits(ids), dsv41.load(quantized_dir).logits(ids))


def test_config_json_written_is_release_style(quantized_dir):
    raw = json.loads((quantized_dir / "config.json").read_text())
    assert raw["model_type"] == "deepseek_v41" and raw["text_config"]["model_type"] == "deepseek_v41_text"
    assert raw["quantization_config"]["weight_block_size"] == [32, 32]


def test_converted_orbax_checkpoint_restores_identical(quantized_dir, tmp_path):
    m = dsv41.load(quantized_dir, dtype="bfloat16")
    m.save_converted(tmp_path / "conv")
    back = dsv41.load(tmp_path / "conv")
    assert back.dtype == m.dtype and set(back.params) == set(m.params)
    for p, v in m.params.items():
        assert back.params[p].dtype == v.dtype and np.array_equal(np.asarray(back.params[p]), np.asarray(v)), p
    assert back.params[("layers", 1, "engram", "embed", "weight")].dtype == ml_dtypes.float8_e4m3fn
    with pytest.raises(CheckpointError, match="converted to bfloat16"):
        dsv41.load(tmp_path / "conv", dtype="float32")


def test_v4_quantized_round_trip_uses_128_blocks(tmp_path):
    from pathlib import Path

    raw = json.loads((Path(__file__).parent / "fixtures/oracle/v4_tiny/config.json").read_text())
    m = dsv41.random_model(dsv41.ModelConfig.from_release_dict(raw), seed=4)
    params = {p: np.asarray(v) for p, v in m.params.items()}
    save_checkpoint(tmp_path, m.config, params, quantize=True)
    entries = open_checkpoint(tmp_path)
    assert entries["layers.1.attn.wq_b.scale"].shape == (1, 1)  # [128, 32] weight, 128x128 tiles
    assert entries["layers.0.ffn.gate.tid2eid"].dtype == "I32" and "layers.0.ffn.gate.bias" not in entries
    assert entries["layers.1.attn.indexer.compressor.ape"].dtype == "F32" and "hc_head_fn" in entries
    back = dsv41.load(tmp_path, weights="dequantize")
    assert dsv41.load(tmp_path).formats[("layers", 1, "attn", "wq_b")] == ("fp8", (128, 128))
    w = params[("layers", 1, "attn", "wq_b", "weight")]
    np.testing.assert_array_equal(np.asarray(back.params[("layers", 1, "attn", "wq_b", "weight")]),
                                  quant.dequantize_fp8_blocks(*quant.quantize_fp8_blocks(w, (128, 128)), (128, 128)))
    np.testing.assert_array_equal(np.asarray(back.params[("layers", 0, "ffn", "gate", "tid2eid")]),
                                  params[("layers", 0, "ffn", "gate", "tid2eid")])
