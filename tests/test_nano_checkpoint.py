"""The committed nano-austen checkpoint (`dsv41.nano`): a trained model in the release formats, the built-in
default of the server and of `serving.LLM()`."""

import json

import numpy as np

import dsv41
from dsv41 import nano
from dsv41.safetensors_io import open_checkpoint
from serving import model_source
from serving.model_source import DEFAULT_NAME, ModelArgs, load_model

PASSAGES, LENGTH = 3, 512


def test_heldout_perplexity_from_the_committed_weights_beats_unigram_by_far():
    """Recomputed from the weights on the first passages of *Persuasion* (never trained on)."""
    model = dsv41.load(nano.NANO_DIR)
    windows = nano.passages(LENGTH, PASSAGES)
    nll, unigram = [], []
    for w in windows:
        logits = model.logits(w).astype(np.float64)[:-1]
        top = logits.max(-1, keepdims=True)
        nll.append(top[:, 0] + np.log(np.exp(logits - top).sum(-1)) - logits[np.arange(LENGTH - 1), w[1:]])
        unigram.append(nano.unigram_nll(w[1:]))
    ppl, ppl_unigram = float(np.exp(np.mean(nll))), float(np.exp(np.mean(unigram)))
    print(f"\nnano-austen held-out perplexity on {PASSAGES} x {LENGTH} tokens: {ppl:.1f} "
          f"(unigram baseline of the same tokenizer: {ppl_unigram:.1f})")
    assert np.isfinite(ppl) and ppl < ppl_unigram / 3


def test_the_folder_holds_the_release_formats_within_its_size_budget():
    entries = open_checkpoint(nano.NANO_DIR)
    dtypes = {e.dtype for e in entries.values()}
    assert {"F8_E4M3", "F8_E8M0", "I8", "BF16", "F32"} <= dtypes
    assert entries["layers.2.attn.wq_a.weight"].dtype == "F8_E4M3"
    assert entries["layers.2.ffn.experts.0.w1.weight"].dtype == "I8"  # MXFP4, two codes per byte
    assert entries["layers.1.engram.embed.weight"].dtype == "F8_E4M3"
    total = sum(p.stat().st_size for p in nano.NANO_DIR.rglob("*") if p.is_file())
    assert total < 25e6, total
    report = json.loads((nano.NANO_DIR / "export.json").read_text())
    assert report["check_release_vs_quantized_params"]["max_abs_logit_diff"] == 0.0


def test_heldout_text_is_the_novel_and_tokenizes_as_training_did():
    tokens = nano.heldout_tokens()
    assert tokens.size == 121112 and tokens[-1] == 1  # the novel, then EOS
    assert round(float(np.exp(nano.unigram_nll(tokens).mean())), 1) == 699.7  # dsv41.train.data's figure


def test_default_model_is_nano_austen_with_its_tokenizer():
    src = load_model(ModelArgs())
    assert src.name == DEFAULT_NAME and "nano-austen" in src.description
    assert src.model.config.num_hidden_layers == 10 and src.model.config.vocab_size == 8192
    text = "Anne Elliot walked to Uppercross."
    assert src.tokenizer.decode(src.tokenizer.encode(text)) == text


def test_engram_tables_stay_in_host_memory_by_default_only_on_an_accelerator(monkeypatch):
    """On a CPU backend the default keeps nano-austen's FP8 tables as device arrays (host memory already; so the
    default model serves async); the flag still maps them apart, and an accelerator's default does."""
    assert load_model(ModelArgs()).model.engram_tables is None
    assert load_model(ModelArgs(engram_cpu_offload=True)).model.engram_tables is not None
    monkeypatch.setattr(model_source.jax, "default_backend", lambda: "gpu")
    assert model_source.engram_offload(None) and not model_source.engram_offload(False)
    assert load_model(ModelArgs()).model.engram_tables is not None
