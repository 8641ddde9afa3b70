"""The target's own greedy continuations of training-split prompts: data for the drafter (`python -m dsv41.train
--dspark-data`), which at serving time drafts continuations of the target's outputs, not of the corpus.

    python tools/target_outputs.py --out runs/target_outputs.npy            # the built-in nano-austen
    python -m dsv41.train --out runs/nano-dspark-self --backbone-steps 0 --init-from dsv41/checkpoints/nano-austen \\
        --dspark-data runs/target_outputs.npy --seq-len 512 ...

Each row is a training window as `dsv41.train.data.Windows` draws them, [seq_len + 1] int32: BOS, `--prompt-len`
- 1 consecutive training-split tokens from a seeded random start, then the model's greedy continuation (float32,
the served engine, EOS ignored) to seq_len + 1 tokens. Prompts come from the training split only, so the held-out
novel that acceptance is measured on stays unseen. Rows are a function of (--seed, --sequences, lengths, model).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def prompts(train_tokens: np.ndarray, n: int, prompt_len: int, seed: int, bos_id: int) -> list[list[int]]:
    """n prompts: BOS + prompt_len - 1 consecutive tokens from seeded random starts of the training split."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, train_tokens.size - prompt_len, n)
    return [[bos_id] + [int(t) for t in train_tokens[s: s + prompt_len - 1]] for s in starts]


def generate(llm, prompt_ids: list[list[int]], new_tokens: int) -> np.ndarray:
    """[n, prompt_len + new_tokens] int32: each prompt and its greedy continuation."""
    from serving.runtime.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params)
    rows = [p + list(r.outputs[0].token_ids) for p, r in zip(prompt_ids, out)]
    if any(len(r) != len(rows[0]) for r in rows):
        raise RuntimeError("a continuation stopped early (EOS is ignored, so none should)")
    return np.asarray(rows, np.int32)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="the .npy file written")
    ap.add_argument("--model", default=None, help="a checkpoint folder (default: the built-in nano-austen)")
    ap.add_argument("--data", type=Path, default=None, help="the prepared corpus (default: dsv41.train's)")
    ap.add_argument("--sequences", type=int, default=1024)
    ap.add_argument("--prompt-len", type=int, default=64, help="BOS included")
    ap.add_argument("--seq-len", type=int, default=512, help="tokens per training window (rows hold seq_len + 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    a = ap.parse_args(argv)
    if not 1 < a.prompt_len <= a.seq_len:
        raise SystemExit(f"error: --prompt-len must be in 2 .. --seq-len ({a.seq_len}), got {a.prompt_len}")

    from dsv41.train.data import DEFAULT_DATA_DIR, DataError, load_tokens
    from serving.llm import LLM

    try:
        train = load_tokens(a.data or DEFAULT_DATA_DIR, "train")
    except DataError as e:
        raise SystemExit(f"error: {e}") from None
    new_tokens = a.seq_len + 1 - a.prompt_len
    llm = LLM(a.model, dtype="float32", max_num_seqs=a.max_num_seqs, max_model_len=a.seq_len + 16,
              max_num_batched_tokens=512, token_buckets=(a.max_num_seqs, 512))
    bos = llm.source.model.config.bos_token_id
    t0 = time.perf_counter()
    rows = generate(llm, prompts(train, a.sequences, a.prompt_len, a.seed, bos), new_tokens)
    seconds = time.perf_counter() - t0
    a.out.parent.mkdir(parents=True, exist_ok=True)
    np.save(a.out, rows)
    meta = {"model": a.model or "nano-austen", "sequences": a.sequences, "prompt_len": a.prompt_len,
            "seq_len": a.seq_len, "seed": a.seed, "generated_tokens": a.sequences * new_tokens,
            "seconds": round(seconds, 1)}
    a.out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
