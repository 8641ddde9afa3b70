"""The nano tokenizer: byte-level BPE with V4.1's special tokens at the serving tokenizer's ids, loadable by
the serving loader, encoding chat prompts, round-tripping any text."""

import pytest

from dsv41.layers.engram import build_compressed_token_map
from dsv41.special_tokens import SPECIAL_TOKENS
from dsv41.train.tokenizer import noise_token_id, train_tokenizer
from serving.text.encoding import encode_messages, encode_messages_to_ids
from serving.text.tokenizer import Tokenizer
from tests.train.test_data import PREPARED, needs_corpus, persuasion_passage


@pytest.fixture(scope="module")
def small_tokenizer_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    train_tokenizer([persuasion_passage()], folder, vocab_size=512)
    return folder


def _check(tok: Tokenizer, vocab_size: int) -> None:
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (0, 1, 2, vocab_size)
    for i, (text, special) in enumerate(SPECIAL_TOKENS):
        assert tok.token_id(text) == i and tok.encode(text) == [i]
        assert tok.is_skipped(i) == special  # <think>, </think>, ｜DSML｜ survive skip_special
    assert tok.decode([noise_token_id(vocab_size)]).startswith("<｜reserved_")
    for text in (persuasion_passage()[:500], "Ünïcödé — ‘quotes’ 😀\n\ttabs  and  spaces", " leading space"):
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")
    messages = [{"role": "system", "content": "You are Anne."}, {"role": "user", "content": "Who is Wentworth?"}]
    ids = encode_messages_to_ids(tok, messages)
    assert ids[0] == tok.bos_id and tok.token_id("<｜User｜>") in ids and ids[-1] == tok.token_id("<think>")
    assert tok.decode(ids) == encode_messages(messages)


def test_trained_tokenizer_loads_in_serving_and_encodes_chat(small_tokenizer_dir):
    tok = Tokenizer.from_dir(small_tokenizer_dir)
    _check(tok, 512)
    assert len(tok.encode(persuasion_passage())) < len(persuasion_passage().encode()) / 2  # merges learned
    token_map, size = build_compressed_token_map(small_tokenizer_dir / "tokenizer.json", 512, 2)
    assert token_map.shape == (512,) and 0 < size <= 512


def test_vocab_too_small_is_refused():
    with pytest.raises(ValueError, match="vocab_size 200"):
        train_tokenizer(["abc"], vocab_size=200)


@needs_corpus
def test_prepared_tokenizer():
    tok = Tokenizer.from_dir(PREPARED / "tokenizer")
    _check(tok, 8192)
    from dsv41.config import ModelConfig

    c = ModelConfig.preset("nano")
    _, size = build_compressed_token_map(PREPARED / "tokenizer" / "tokenizer.json", c.vocab_size,
                                         c.engram_pad_token_id)
    assert size == c.engram_compressed_vocab_size and tok.vocab_size == c.vocab_size
