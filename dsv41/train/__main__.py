"""python -m dsv41.train: train a V4.1 model (default: the nano preset) on the prepared Austen corpus.

    python -m dsv41.train.data                        # once: corpus, split, tokenizer (see dsv41.train.data)
    python -m dsv41.train --out runs/nano             # backbone, then DSpark; resumes from runs/nano
    python -m dsv41.train --out runs/nano --backbone-steps 20 --dspark-steps 5 --seq-len 256   # a quick look
    python tools/target_outputs.py --out runs/self.npy --seq-len 256      # the target's own continuations, then
    python -m dsv41.train --out runs/nano-self --backbone-steps 0 --init-from dsv41/checkpoints/nano-austen \
        --seq-len 256 --dspark-data runs/self.npy                         # the drafter trained on them

Writes into --out: train_config.json, log.jsonl (every step), checkpoints/ (Orbax; a rerun resumes from the
newest), results.json (held-out perplexity vs the unigram baseline, tokens/s, wall time) and model/ (the
trained parameters as a converted checkpoint with tokenizer.json: `dsv41.load("runs/nano/model")`, or
`python -m serving.server --model runs/nano/model`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np

from dsv41.config import ConfigError, load_config
from dsv41.train.config import add_flags, from_args
from dsv41.train.data import DEFAULT_DATA_DIR, DataError, load_tokens, unigram_perplexity


def export_model(trainer, state: dict, folder: Path, tokenizer_dir: Path) -> None:
    """The trained parameters as a converted checkpoint (Orbax) plus the tokenizer files."""
    from dsv41.api import Model
    from dsv41.train.loop import _graph

    _, paths, _ = _graph(trainer.config)
    flat = {paths[k]: np.asarray(v) for group in state["params"].values() for k, v in group.items()}
    Model(trainer.config, flat, token_map=trainer.token_map).save_converted(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m dsv41.train", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--config", default="nano", help="a preset name or a config.json (default nano)")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA_DIR, help=f"prepared corpus (default {DEFAULT_DATA_DIR})")
    ap.add_argument("--out", type=Path, required=True, help="run folder (resumed when it holds checkpoints)")
    ap.add_argument("--stop-at", type=int, default=None, help="stop after this global step (resume later)")
    add_flags(ap)
    a = ap.parse_args(argv)
    from dsv41.layers.engram import build_compressed_token_map
    from dsv41.train.loop import Trainer

    try:
        tc = from_args(a)
        config = load_config(a.config)
        train, heldout = load_tokens(a.data, "train"), load_tokens(a.data, "heldout")
        tokenizer_dir = a.data / "tokenizer"
        token_map = None
        if config.engram_layer_ids:
            token_map, size = build_compressed_token_map(tokenizer_dir / "tokenizer.json", config.vocab_size,
                                                         config.engram_pad_token_id)
            if size != config.engram_compressed_vocab_size:
                raise ConfigError(f"engram_compressed_vocab_size is {config.engram_compressed_vocab_size} but "
                                  f"{tokenizer_dir / 'tokenizer.json'} gives {size} compressed ids")
        trainer = Trainer(config, tc, train, heldout, a.out, token_map=token_map)
    except (ConfigError, DataError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    unigram = unigram_perplexity(train, heldout, config.vocab_size)
    print(f"{a.config}: train {train.size:,} tokens, held-out {heldout.size:,} tokens "
          f"(unigram held-out perplexity {unigram:.1f}); {tc.tokens_per_step:,} tokens per step")
    t0 = time.perf_counter()
    state = trainer.run(stop_at=a.stop_at)
    wall = time.perf_counter() - t0
    if int(state["step"]) < tc.backbone_steps + tc.dspark_steps:
        print(f"\nstopped at step {int(state['step'])} ({wall:.0f} s); rerun the same command to resume")
        return
    final = trainer.history[-1] if trainer.history else {}
    results = {"config": a.config, "unigram_heldout_ppl": unigram, "wall_s_this_process": round(wall, 1),
               "tokens_per_s": trainer.tokens_per_s, **{k: v for k, v in final.items() if k.startswith("heldout")}}
    (a.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    export_model(trainer, state, a.out / "model", tokenizer_dir)
    print("\n" + json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
