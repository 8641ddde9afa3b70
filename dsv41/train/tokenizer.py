"""The nano model's tokenizer: a byte-level BPE trained on the corpus, with V4.1's special tokens.

Id layout (`vocab_size` ids, 8192 by default):

    0 .. 16                         the V4.1 special tokens, in the order and ids of the serving byte-level
                                    tokenizer (bos 0, eos 1, pad 2, roles, <think>, </think>, ｜DSML｜, ...), so
                                    the chat encoding (`serving.text.encoding`) works and Engram's pad id is 2
    17 .. vocab_size - N_RESERVED   BPE tokens (GPT-2 byte alphabet first, then merges)
    the last N_RESERVED ids         <｜reserved_K｜>; the last one is DSpark's noise token

`<think>`, `</think>` and `｜DSML｜` are added as non-special tokens: decode(skip_special=True) must keep them
for the reasoning and tool-call parsers (as `serving.text.tokenizer` does). Both take the
table from `dsv41.special_tokens`.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from dsv41.special_tokens import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS

N_RESERVED = 16


def noise_token_id(vocab_size: int) -> int:
    """DSpark's noise token: the last reserved id."""
    return vocab_size - 1


def train_tokenizer(documents: list[str], out_dir: Path | None = None, *, vocab_size: int = 8192,
                    min_frequency: int = 2) -> Tokenizer:
    """Train on `documents` and (with `out_dir`) write tokenizer.json + tokenizer_config.json there."""
    n_fixed = len(SPECIAL_TOKENS)
    n_bpe = vocab_size - n_fixed - N_RESERVED
    if n_bpe < 256:
        raise ValueError(f"vocab_size {vocab_size} leaves {n_bpe} BPE ids; the byte alphabet alone needs 256")
    # Train without special tokens, then shift every BPE id up by the special block, so the specials
    # keep the serving tokenizer's ids whatever the corpus.
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(documents, trainers.BpeTrainer(
        vocab_size=n_bpe, min_frequency=min_frequency, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model = json.loads(bpe.to_str())["model"]
    if len(model["vocab"]) != n_bpe:
        raise ValueError(f"the corpus gave {len(model['vocab'])} BPE tokens, fewer than the {n_bpe} asked for: "
                         "lower vocab_size")
    vocab = {text: i for i, (text, _) in enumerate(SPECIAL_TOKENS)}
    vocab.update({text: n_fixed + i for text, i in model["vocab"].items()})
    reserved = [f"<｜reserved_{k}｜>" for k in range(vocab_size - N_RESERVED, vocab_size)]
    vocab.update({text: vocab_size - N_RESERVED + k for k, text in enumerate(reserved)})
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Registering tokens already in the model vocabulary keeps their ids.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, special in SPECIAL_TOKENS
                            if special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, special in SPECIAL_TOKENS
                    if not special])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in reserved])
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise AssertionError(f"built {tok.get_vocab_size(with_added_tokens=True)} ids, expected {vocab_size}")
    if out_dir is not None:
        save_tokenizer(tok, out_dir)
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: Path) -> None:
    """tokenizer.json and the tokenizer_config.json the serving loader reads (bos/eos/pad names)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN,
              "add_bos_token": False, "add_eos_token": False}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n",
                                                   encoding="utf-8")
