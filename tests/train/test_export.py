"""python -m dsv41.train.export: a run's model -> the release layout, checked against the quantized parameters."""

import json
import lzma

import numpy as np

import dsv41
from dsv41 import nano
from dsv41.api import abstract_params
from dsv41.init import random_params
from dsv41.safetensors_io import open_checkpoint
from dsv41.train.export import export, main


def _fake_run(tmp_path):
    """A finished run's folder (random nano weights standing in for trained ones) and a prepared corpus."""
    run, data = tmp_path / "run", tmp_path / "data"
    c = dsv41.load_config("nano")
    _, abstract = abstract_params(c)
    # the committed tokenizer's compressed Engram ids (random_model has no tokenizer to build them from)
    model = dsv41.Model(c, random_params(c, abstract, 1), token_map=dsv41.load(nano.NANO_DIR).token_map)
    model.save_converted(run / "model")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (run / "model" / name).write_bytes((nano.NANO_DIR / name).read_bytes())
    (run / "results.json").write_text(json.dumps({"heldout_ppl": 1.0}))
    data.mkdir()
    (data / "heldout.txt").write_bytes(lzma.decompress((nano.NANO_DIR / nano.HELDOUT_TEXT).read_bytes()))
    np.save(data / "heldout.tokens.npy", nano.heldout_tokens().astype(np.uint16))
    np.save(data / "train.tokens.npy", np.random.default_rng(0).integers(0, 8192, 5000).astype(np.uint16))
    return run, data, model


def test_export_writes_release_formats_equal_to_the_quantized_parameters(tmp_path):
    run, data, model = _fake_run(tmp_path)
    report = export(run, tmp_path / "out", data, eval_windows_n=1, seq_len=128)
    check = report["check_release_vs_quantized_params"]
    assert check["max_abs_param_diff"] == 0.0 and check["max_abs_logit_diff"] == 0.0
    entries = open_checkpoint(tmp_path / "out")
    assert entries["layers.3.attn.wo_b.weight"].dtype == "F8_E4M3" and entries["layers.3.ffn.experts.1.w2.weight"].dtype == "I8"
    # the quantization moved the weights (so the zero above compares something), but only by its resolution
    exported = dsv41.load(tmp_path / "out", weights="dequantize")
    path = ("layers", 3, "attn", "wo_b", "weight")
    w, q = np.asarray(model.params[path]), np.asarray(exported.params[path])
    assert 0 < np.abs(w - q).max() <= np.abs(w).max() / 8  # e4m3: 3 mantissa bits
    assert report["run"] == "run"  # the folder's name: a committed report names no machine path
    assert report["heldout"]["ppl_exported_release"] > 0 and (tmp_path / "out" / "export.json").is_file()
    assert np.array_equal(nano.heldout_tokens(tmp_path / "out"), nano.heldout_tokens())


def test_export_names_what_is_missing(tmp_path, capsys):
    try:
        main([str(tmp_path / "nowhere"), "--out", str(tmp_path / "out"), "--data", str(tmp_path)])
    except SystemExit as e:
        assert "nowhere/model/config.json is missing" in str(e)
    else:
        raise AssertionError("no error")
