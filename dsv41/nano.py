"""The committed nano-austen checkpoint: the default model of `make serve` and `serving.LLM()`.

A nano V4.1 (every layer role of the full model at width 128, `dsv41/presets/nano.json`) trained here on
five of Jane Austen's novels by `python -m dsv41.train` and exported in the release layout (FP8 linears with
UE8M0 32x32 scales, MXFP4 experts, FP8 Engram rows, BF16 / F32 elsewhere) by `python -m dsv41.train.export`,
so it loads through the same path as the real checkpoint. `NANO_DIR/README.md` is its card.

Its evaluation data travel with it (`eval/`), so tests and `serving.bench.replay_quality` need no download:
the held-out novel (*Persuasion*, never trained on) as text, and the training split's token counts for the
unigram baseline.
"""

from __future__ import annotations

import hashlib
import lzma
from functools import cache
from pathlib import Path

import numpy as np

from dsv41.special_tokens import EOS_TOKEN

NANO_DIR = Path(__file__).resolve().parent / "checkpoints" / "nano-austen"
HELDOUT_TEXT = "eval/persuasion.txt.xz"  # the novel exactly as dsv41.train.data wrote heldout.txt
TRAIN_UNIGRAM = "eval/train_unigram_counts.npy"  # int64 [vocab]: token counts of the training split
# dsv41.train.data.NOVEL_SHA256["persuasion"]: the text the held-out tokens were cut from
HELDOUT_SHA256 = "8061549557aebd2fd6e353d18d9197cb707029112bd52d4d8b174583a925848a"


def heldout_text(folder: Path = NANO_DIR) -> str:
    text = lzma.decompress((Path(folder) / HELDOUT_TEXT).read_bytes()).decode("utf-8")
    got = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if got != HELDOUT_SHA256:
        raise ValueError(f"{Path(folder) / HELDOUT_TEXT}: sha256 {got} is not the held-out novel's")
    return text


@cache
def heldout_tokens(folder: Path = NANO_DIR) -> np.ndarray:
    """int32 [N]: *Persuasion* tokenized as training tokenized its splits (the ids, then EOS)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
    return np.asarray(tok.encode(heldout_text(folder)).ids + [tok.token_to_id(EOS_TOKEN)], np.int32)


def passages(length: int, n: int, folder: Path = NANO_DIR, bos_id: int = 0) -> np.ndarray:
    """int32 [n, length]: BOS + the next length - 1 held-out tokens, consecutive non-overlapping passages from
    the start of the novel (as training's evaluation windows)."""
    tokens = heldout_tokens(folder)
    body = length - 1
    if n * body > tokens.size:
        raise ValueError(f"{n} passages of {length} tokens need {n * body} held-out tokens; there are {tokens.size}")
    rows = tokens[: n * body].reshape(n, body)
    return np.concatenate([np.full((n, 1), bos_id, np.int32), rows], axis=1)


def unigram_nll(ids: np.ndarray, folder: Path = NANO_DIR) -> np.ndarray:
    """Per-token negative log-likelihood of `ids` under the add-one-smoothed unigram distribution of the
    training split (the baseline `dsv41.train.data.unigram_perplexity` reports)."""
    counts = np.load(Path(folder) / TRAIN_UNIGRAM).astype(np.float64) + 1.0
    return -np.log(counts / counts.sum())[np.asarray(ids, np.int64)]
