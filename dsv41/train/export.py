"""python -m dsv41.train.export: a trained run's model -> a release-layout checkpoint folder, checked.

    python -m dsv41.train.export runs/nano --out dsv41/checkpoints/nano-austen

Reads RUN/model (the converted checkpoint `python -m dsv41.train` writes), RUN/results.json and the prepared
corpus (`--data`), and writes into --out:

    config.json, model.safetensors   the release layout with the release formats (`dsv41.checkpoint`:
                                     FP8 e4m3 linears with UE8M0 32x32 scales, MXFP4 routed experts, FP8 Engram
                                     rows, BF16 / F32 elsewhere), loaded by `dsv41.load` like the real one
    tokenizer.json, tokenizer_config.json
    eval/                            the held-out novel (xz text) and the training split's unigram counts
                                     (`dsv41.nano`), so evaluation needs no corpus download
    export.json                      the checks below, with their numbers

Checks (refused export if the first fails): the folder, loaded back, holds exactly the trained parameters passed
through the release quantization (decoded here from the quantized arrays, independently of the loader), so its
logits equal theirs (max |diff| reported, 0 expected); and what the quantization costs: held-out perplexity of
the trained float32 parameters vs the exported ones on the same windows.

`--drafter-only` (a run that trained only the drafter, `--backbone-steps 0 --init-from` the folder): the export is
checked as above in a folder beside --out, then only its DSpark tensors (`mtp.*`) replace --out's; every other
tensor of --out stays byte for byte (a dequantized tensor quantized again need not give the same bytes), so the
target is exactly the one the drafter was trained against and its outputs do not move. export.json gains a
"drafter" entry.
"""

from __future__ import annotations

import argparse
import json
import lzma
import shutil
import time
from pathlib import Path

import ml_dtypes
import numpy as np

import dsv41
from dsv41 import checkpoint, nano, quant
from dsv41.safetensors_io import SINGLE_NAME, open_checkpoint, write_safetensors
from dsv41.train.data import DEFAULT_DATA_DIR, eval_windows, load_tokens


def release_roundtrip(config: dsv41.ModelConfig, params: dict[tuple, np.ndarray]) -> dict[tuple, np.ndarray]:
    """`params` as the release formats represent them: quantized by the export (`export_tensors`), then decoded
    here by dtype. The FP8 Engram tables stay FP8 (rows + exponent bytes), as the loader keeps them."""
    tensors, _ = checkpoint.export_tensors(config, params, quantize=True)
    block = tuple(checkpoint.release_quantization(config)["weight_block_size"])
    out = {p: np.array(v, dtype=np.float32) for p, v in params.items()}
    for name, t in checkpoint.release_names(config, list(params)).items():
        a = tensors[name]
        if name.endswith("engram.embed.weight"):  # the model reads the FP8 rows directly
            out[t.path] = a
            out[t.path[:-1] + ("scale",)] = tensors[name[:-7] + ".scale"]
            continue
        if a.dtype == np.int8:
            value = quant.dequantize_mxfp4(a, tensors[name[:-7] + ".scale"])
        elif a.dtype == ml_dtypes.float8_e4m3fn:
            value = quant.dequantize_fp8_blocks(a, tensors[name[:-7] + ".scale"], block)
        else:
            value = np.asarray(a, np.float32)
        if t.expert is None:
            out[t.path] = value.astype(np.float32)
        else:
            out[t.path][t.expert] = value
    return out


def heldout_nll(model: dsv41.Model, windows: np.ndarray) -> np.ndarray:
    """[n, T - 1] next-token negative log-likelihoods of each window (the model's exact forward)."""
    rows = []
    for w in windows:
        logits = model.logits(w).astype(np.float64)[:-1]
        top = logits.max(-1, keepdims=True)
        logz = top[:, 0] + np.log(np.exp(logits - top).sum(-1))
        rows.append(logz - logits[np.arange(len(w) - 1), w[1:]])
    return np.stack(rows)


def export(run: Path, out: Path, data: Path, *, eval_windows_n: int = 8, seq_len: int = 1024) -> dict:
    trained = dsv41.load(run / "model")
    c = trained.config
    params = {p: np.asarray(v) for p, v in trained.params.items()}
    out.mkdir(parents=True, exist_ok=True)
    checkpoint.save_checkpoint(out, c, params, quantize=True)
    shutil.copy(run / "model" / "tokenizer.json", out / "tokenizer.json")
    # nano was never trained to close a thinking block: chat defaults to thinking off (the server's
    # --default-chat-template-kwargs reads this field)
    tok_config = json.loads((run / "model" / "tokenizer_config.json").read_text())
    tok_config["chat_template_kwargs"] = {**tok_config.get("chat_template_kwargs", {}), "thinking": False}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")
    (out / "eval").mkdir(exist_ok=True)
    (out / nano.HELDOUT_TEXT).write_bytes(lzma.compress((data / "heldout.txt").read_bytes(), preset=9))
    counts = np.bincount(load_tokens(data, "train").astype(np.int64), minlength=c.vocab_size)[: c.vocab_size]
    np.save(out / nano.TRAIN_UNIGRAM, counts.astype(np.int64))
    if not np.array_equal(nano.heldout_tokens(out), load_tokens(data, "heldout")):
        raise SystemExit(f"error: {out / nano.HELDOUT_TEXT} does not tokenize to {data}/heldout.tokens.npy")

    exported = dsv41.load(out)  # as served: weights kept in their release formats
    decoded = dsv41.load(out, weights="dequantize").params
    expected = release_roundtrip(c, params)
    param_diff = max(float(np.abs(np.asarray(decoded[p], np.float32) - np.asarray(v, np.float32)).max())
                     for p, v in expected.items())
    windows = eval_windows(nano.heldout_tokens(out), seq_len, limit=eval_windows_n)
    roundtrip = dsv41.Model(c, expected, token_map=exported.token_map)
    logit_diff = max(float(np.abs(exported.logits(w) - roundtrip.logits(w)).max()) for w in windows[:2])
    if param_diff or logit_diff:
        raise SystemExit(f"error: the exported folder differs from the quantized parameters "
                         f"(params {param_diff}, logits {logit_diff})")
    nll_trained, nll_exported = heldout_nll(trained, windows), heldout_nll(exported, windows)
    unigram = nano.unigram_nll(windows[:, 1:], out)
    report = {
        "run": run.name, "exported": time.strftime("%Y-%m-%d"),
        "files_bytes": {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()},
        "check_release_vs_quantized_params": {"max_abs_param_diff": param_diff, "max_abs_logit_diff": logit_diff,
                                              "windows": 2, "tokens_per_window": seq_len},
        "heldout": {"windows": len(windows), "tokens_per_window": seq_len, "tokens": int(unigram.size),
                    "ppl_trained_float32": float(np.exp(nll_trained.mean())),
                    "ppl_exported_release": float(np.exp(nll_exported.mean())),
                    "ppl_unigram": float(np.exp(unigram.mean())),
                    "max_abs_logit_diff_trained_vs_exported": float(
                        np.abs(trained.logits(windows[0]) - exported.logits(windows[0])).max())},
        "training": json.loads((run / "results.json").read_text()),
    }
    (out / "export.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def splice_drafter(exported: Path, out: Path) -> dict:
    """--out's model.safetensors with the DSpark tensors of `exported` (same names, shapes and formats required)."""
    old, new = open_checkpoint(out), open_checkpoint(exported)
    if set(old) != set(new):
        raise SystemExit(f"error: {exported} and {out} hold different tensors: {sorted(set(old) ^ set(new))[:5]}")
    tensors, e8m0, replaced = {}, set(), 0
    for name, entry in old.items():
        src = new[name] if name.startswith("mtp.") else entry
        if (src.dtype, src.shape) != (entry.dtype, entry.shape):
            raise SystemExit(f"error: {name} is {src.dtype} {src.shape} in {exported}, {entry.dtype} {entry.shape} "
                             f"in {out}")
        tensors[name] = np.array(src.read())
        if src.dtype == "F8_E8M0":
            e8m0.add(name)
        replaced += name.startswith("mtp.")
    tmp = out / (SINGLE_NAME + ".tmp")
    write_safetensors(tmp, tensors, e8m0)
    tmp.replace(out / SINGLE_NAME)
    kept = open_checkpoint(out)
    for name, entry in old.items():
        want = new[name] if name.startswith("mtp.") else entry
        if not np.array_equal(kept[name].read().view(np.uint8), want.read().view(np.uint8)):
            raise SystemExit(f"error: {name} did not survive the splice")
    return {"replaced_tensors": replaced, "kept_tensors": len(old) - replaced}


def export_drafter(run: Path, out: Path, data: Path, *, eval_windows_n: int = 8, seq_len: int = 1024) -> dict:
    """`--drafter-only`: the run exported and checked beside `out`, then its DSpark tensors spliced into `out`;
    returns export.json's new "drafter" entry."""
    staging = out.with_name(out.name + ".drafter-export")
    report = export(run, staging, data, eval_windows_n=eval_windows_n, seq_len=seq_len)
    spliced = splice_drafter(staging, out)
    shutil.rmtree(staging)
    export_json = out / "export.json"
    full = json.loads(export_json.read_text())
    full["drafter"] = {"run": run.name, "exported": time.strftime("%Y-%m-%d"), **spliced,
                       "check_release_vs_quantized_params": report["check_release_vs_quantized_params"],
                       "training": report["training"]}
    export_json.write_text(json.dumps(full, indent=1) + "\n")
    return full["drafter"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m dsv41.train.export", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("run", type=Path, help="a finished `python -m dsv41.train` run folder")
    ap.add_argument("--out", type=Path, default=nano.NANO_DIR, help=f"output folder (default {nano.NANO_DIR})")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA_DIR, help=f"prepared corpus (default {DEFAULT_DATA_DIR})")
    ap.add_argument("--eval-windows", type=int, default=8, help="held-out windows of 1024 tokens for the report")
    ap.add_argument("--drafter-only", action="store_true", help="replace only --out's DSpark tensors (docstring)")
    a = ap.parse_args(argv)
    for need in (a.run / "model" / "config.json", a.run / "results.json", a.data / "heldout.txt"):
        if not need.is_file():
            raise SystemExit(f"error: {need} is missing (train with `python -m dsv41.train`, data with "
                             "`python -m dsv41.train.data`)")
    if a.drafter_only:
        print(json.dumps(export_drafter(a.run, a.out, a.data, eval_windows_n=a.eval_windows), indent=1))
    else:
        print(json.dumps(export(a.run, a.out, a.data, eval_windows_n=a.eval_windows), indent=1))


if __name__ == "__main__":
    main()
