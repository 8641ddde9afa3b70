"""`python -m dsv41.logits CHECKPOINT_DIR --input-ids 0,17,5 [--dtype float32] [--fake-quant] --out FILE.npy`

Writes the [T, vocab] float32 logits of the exact full-sequence forward (every layer on every row).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


def _ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--input-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--input-ids is empty")
    return ids


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv41.logits", description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", type=Path, help="folder with config.json and the release safetensors")
    ap.add_argument("--input-ids", type=_ids, required=True, help="comma-separated token ids, e.g. 0,17,5")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--fake-quant", action="store_true",
                    help="apply the reference's activation fake-quantization (SWA FP8, global KV NVFP4, indexer MXFP4)")
    ap.add_argument("--out", type=Path, required=True, help="output .npy file")
    args = ap.parse_args(argv)

    import dsv41  # after argument parsing: --help stays instant

    try:
        model = dsv41.load(args.checkpoint, dtype=args.dtype)
        logits = model.logits(np.asarray(args.input_ids, np.int64), fake_quant=args.fake_quant)
    except (dsv41.ConfigError, dsv41.CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    np.save(args.out, logits.astype(np.float32))
    print(f"wrote {args.out}: logits {list(logits.shape)} float32")
    return 0


if __name__ == "__main__":
    sys.exit(main())
