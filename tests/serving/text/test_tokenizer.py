"""The built-in byte-level tokenizer and checkpoint-folder loading (serving/text/tokenizer.py)."""

import json
import random

import pytest

from dsv41.layers.engram import build_compressed_token_map
from serving.text.tokenizer import SPECIAL_TOKENS, Tokenizer, byte_level_tokenizer

N_SPECIALS = len(SPECIAL_TOKENS)


@pytest.fixture(scope="module")
def tok():
    return byte_level_tokenizer()


def _random_text(rng: random.Random, n: int) -> str:
    """Code points from ASCII, Latin, CJK, emoji and astral planes (no surrogates)."""
    ranges = [(0x00, 0x7F), (0x80, 0x7FF), (0x4E00, 0x9FFF), (0xE000, 0xFFFD), (0x1F300, 0x1FAFF),
              (0x10000, 0x10FFFF)]
    out = []
    for _ in range(n):
        lo, hi = rng.choice(ranges)
        out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


TRICKY = ["", "a", " ", "\n\n", "\r\n\t\x00\x7f", "héllo wörld", "漢字かな交じり文", "😀👍🏽👨‍👩‍👧", "e\u0301",
          "\ufffd", "  leading and trailing  ", "<｜User｜ not a token", "｜DSML｜", "<think>x</think>"]


@pytest.mark.parametrize("text", TRICKY)
def test_round_trip_tricky(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_round_trip_random_utf8(tok):
    rng = random.Random(0)
    for _ in range(200):
        text = _random_text(rng, rng.randint(1, 40))
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert len(ids) == len(text.encode("utf-8"))  # one token per byte: no merges
        assert all(N_SPECIALS <= i < N_SPECIALS + 256 for i in ids)


def test_layout(tok):
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    assert tok.vocab_size == 512
    assert [tok.token_id(text) for text, _ in SPECIAL_TOKENS] == list(range(N_SPECIALS))
    assert tok.encode("\x00A") == [N_SPECIALS, N_SPECIALS + 65]  # byte b -> id N_SPECIALS + b
    assert tok.encode("é") == [N_SPECIALS + 0xC3, N_SPECIALS + 0xA9]
    assert tok.token_id("<｜reserved_511｜>") == 511
    assert tok.is_special(511) and tok.is_special(tok.token_id("<｜User｜>"))
    assert not tok.is_special(tok.token_id("<think>")) and not tok.is_special(N_SPECIALS + 65)


def test_special_text_maps_to_special_ids(tok):
    user, assistant, think = tok.token_id("<｜User｜>"), tok.token_id("<｜Assistant｜>"), tok.token_id("<think>")
    ids = tok.encode("<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜><think>")
    assert ids == [0, user, N_SPECIALS + ord("h"), N_SPECIALS + ord("i"), assistant, think]


def test_skip_special_keeps_parser_markers(tok):
    ids = tok.encode("<｜begin▁of▁sentence｜><think>r</think>a<｜DSML｜ calls><｜end▁of▁sentence｜><｜▁pad▁｜>")
    assert tok.decode(ids, skip_special=True) == "<think>r</think>a<｜DSML｜ calls>"
    assert tok.decode(ids) == "<｜begin▁of▁sentence｜><think>r</think>a<｜DSML｜ calls><｜end▁of▁sentence｜><｜▁pad▁｜>"


def test_vocab_size_too_small():
    with pytest.raises(ValueError, match="vocab_size must be >= 273"):
        byte_level_tokenizer(vocab_size=100)


def test_unknown_token_name(tok):
    with pytest.raises(ValueError, match="'<｜nope｜>'"):
        tok.token_id("<｜nope｜>")


def test_write_and_from_dir(tok, tmp_path):
    tok.write(tmp_path)
    loaded = Tokenizer.from_dir(tmp_path)
    text = "<｜User｜>héllo 😀<｜Assistant｜></think>ok<｜end▁of▁sentence｜>"
    assert loaded.encode(text) == tok.encode(text)
    assert loaded.decode(tok.encode(text), skip_special=True) == "héllo 😀</think>ok"
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id, loaded.vocab_size) == (0, 1, 2, 512)


def test_written_tokenizer_feeds_engram_map(tok, tmp_path):
    tok.write(tmp_path)
    lookup, size = build_compressed_token_map(tmp_path / "tokenizer.json", vocab_size=512, pad_token_id=2)
    assert lookup.shape == (512,)
    assert lookup[N_SPECIALS + ord("A")] == lookup[N_SPECIALS + ord("a")]  # lowercased to one entry
    assert 0 < size < 512


def test_from_dir_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json in"):
        Tokenizer.from_dir(tmp_path)


def test_from_dir_reads_token_names_from_config(tok, tmp_path):
    tok.write(tmp_path)
    # HF configs may give a token as {"content": ...}; a different EOS is honoured
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<｜begin▁of▁sentence｜>"}, "eos_token": "<｜User｜>"}))
    loaded = Tokenizer.from_dir(tmp_path)
    assert loaded.eos_id == tok.token_id("<｜User｜>") and loaded.pad_id == 2
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    with pytest.raises(ValueError, match="bos_token '<s>' is not in the vocabulary"):
        Tokenizer.from_dir(tmp_path)


def test_token_bytes(tok):
    assert tok.token_bytes(N_SPECIALS + 0xE6) == b"\xe6"
    assert tok.token_bytes(tok.token_id("<｜User｜>")) == "<｜User｜>".encode()
    ids = tok.encode("<think>漢😀</think>")
    assert b"".join(tok.token_bytes(i) for i in ids).decode() == tok.decode(ids)
    assert tok.token_bytes(600) == b""  # past the vocabulary (see the next test)


def test_ids_past_the_tokenizer_add_no_text(tok):
    """A model vocabulary padded past the tokenizer's (the peer V4: 8192 rows, 8000 tokens) can sample an id
    the tokenizer lacks: it decodes to nothing instead of stopping the engine."""
    from serving.text.detokenizer import IncrementalDetokenizer

    assert tok.token_bytes(tok.vocab_size + 5) == b""
    d = IncrementalDetokenizer(tok)
    assert d.push(tok.encode("ab") + [tok.vocab_size + 5]) + d.push(tok.encode("c")) == "abc"
