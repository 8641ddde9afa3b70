"""python -m dsv41.train.export: a run's model -> the release layout, checked against the quantized parameters."""

import json
import lzma
import shutil

import numpy as np
import pytest

import dsv41
from dsv41 import checkpoint, nano
from dsv41.api import abstract_params
from dsv41.init import random_params
from dsv41.safetensors_io import open_checkpoint
from dsv41.train.export import export, export_drafter, main

pytestmark = pytest.mark.slow  # the second tier (`make test-slow`; tests/README.md)


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


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A fake run exported once for the module (an export compiles and evaluates the model): the run's folder, the
    prepared data, the model, the export's folder and its report."""
    tmp_path = tmp_path_factory.mktemp("export")
    run, data, model = _fake_run(tmp_path)
    report = export(run, tmp_path / "out", data, eval_windows_n=1, seq_len=128)
    return run, data, model, tmp_path / "out", report


def test_export_writes_release_formats_equal_to_the_quantized_parameters(exported):
    _, _, model, out, report = exported
    check = report["check_release_vs_quantized_params"]
    assert check["max_abs_param_diff"] == 0.0 and check["max_abs_logit_diff"] == 0.0
    entries = open_checkpoint(out)
    assert entries["layers.3.attn.wo_b.weight"].dtype == "F8_E4M3" and entries["layers.3.ffn.experts.1.w2.weight"].dtype == "I8"
    # the quantization moved the weights (so the zero above compares something), but only by its resolution
    loaded = dsv41.load(out, weights="dequantize")
    path = ("layers", 3, "attn", "wo_b", "weight")
    w, q = np.asarray(model.params[path]), np.asarray(loaded.params[path])
    assert 0 < np.abs(w - q).max() <= np.abs(w).max() / 8  # e4m3: 3 mantissa bits
    assert report["run"] == "run"  # the folder's name: a committed report names no machine path
    assert report["heldout"]["ppl_exported_release"] > 0 and (out / "export.json").is_file()
    assert np.array_equal(nano.heldout_tokens(out), nano.heldout_tokens())


def test_export_names_what_is_missing(tmp_path, capsys):
    try:
        main([str(tmp_path / "nowhere"), "--out", str(tmp_path / "out"), "--data", str(tmp_path)])
    except SystemExit as e:
        assert "nowhere/model/config.json is missing" in str(e)
    else:
        raise AssertionError("no error")


def test_drafter_only_replaces_the_dspark_tensors_and_keeps_every_other_byte(exported, tmp_path):
    """A drafter-only run (another random model standing in) spliced into a folder: its `mtp.*` tensors are those
    of its own full export, every other tensor the folder's, byte for byte; and the trainer's `init_from` reads
    such a folder back as float32 parameters (FP8 Engram rows decoded)."""
    from dsv41.train.loop import _graph, checkpoint_params

    run, data, _, out, _ = exported
    shutil.copytree(out, tmp_path / "out")  # the splice writes into the folder: a copy of the module's export
    before = {n: np.array(e.read()) for n, e in open_checkpoint(tmp_path / "out").items()}
    c = dsv41.load_config("nano")
    other = dsv41.Model(c, random_params(c, abstract_params(c)[1], 2), token_map=dsv41.load(nano.NANO_DIR).token_map)
    (tmp_path / "run2").mkdir()
    other.save_converted(tmp_path / "run2" / "model")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "run2" / "model" / name).write_bytes((run / "model" / name).read_bytes())
    (tmp_path / "run2" / "results.json").write_bytes((run / "results.json").read_bytes())
    export_drafter(tmp_path / "run2", tmp_path / "out", data, eval_windows_n=1, seq_len=128)
    after = open_checkpoint(tmp_path / "out")
    alone, _ = checkpoint.export_tensors(c, {p: np.asarray(v) for p, v in other.params.items()}, quantize=True)
    mtp = [n for n in after if n.startswith("mtp.")]
    def same(a, b):
        return np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))

    assert mtp and all(same(after[n].read(), alone[n]) for n in mtp)
    assert not all(same(before[n], alone[n]) for n in mtp)  # the drafter did change
    assert all(np.array_equal(after[n].read(), before[n]) for n in after if not n.startswith("mtp."))
    report = json.loads((tmp_path / "out" / "export.json").read_text())
    assert report["drafter"]["replaced_tensors"] == len(mtp) and report["drafter"]["run"] == "run2"
    assert not (tmp_path / "out.drafter-export").exists()
    _, paths, abstract = _graph(c)
    params = checkpoint_params(str(tmp_path / "out"), c, {paths[k]: v for k, v in abstract.items()})
    decoded = dsv41.load(tmp_path / "out", weights="dequantize").params
    path = ("layers", 3, "attn", "wo_b", "weight")
    assert params[path].dtype == np.float32 and np.array_equal(params[path], np.asarray(decoded[path], np.float32))
    table = next(p for p in params if "engram" in p and p[-2:] == ("embed", "weight"))
    assert params[table].dtype == np.float32 and np.abs(params[table]).max() > 0
