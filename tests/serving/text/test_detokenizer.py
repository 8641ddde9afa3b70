"""Incremental detokenizer (serving/text/detokenizer.py) against whole-sequence decode."""

import random

import pytest

from serving.text.detokenizer import IncrementalDetokenizer
from serving.text.tokenizer import SPECIAL_TOKENS, byte_level_tokenizer

FIRST_BYTE_ID = len(SPECIAL_TOKENS)


@pytest.fixture(scope="module")
def tok():
    return byte_level_tokenizer()


TEXTS = ["plain ascii", "😀 emoji 👨‍👩‍👧 family", "漢字とかな", "mixed é ü 😀 漢 <think>r</think> done",
         "\U0010fffd astral", "e\u0301 combining"]


def _check_every_prefix(tok, ids, skip_special=False, max_held=1):
    det = IncrementalDetokenizer(tok, skip_special=skip_special)
    pieces = []
    for k, token_id in enumerate(ids, start=1):
        pieces.append(det.push([token_id]))
        prefix_text = tok.decode(ids[:k], skip_special=skip_special)
        assert prefix_text.startswith(det.text), (k, prefix_text, det.text)
        # only the bytes of one unfinished character (<= 3) are held; decode shows them as U+FFFD
        held = prefix_text[len(det.text):]
        assert set(held) <= {"\ufffd"} and len(held) <= max_held
    pieces.append(det.flush())
    assert "".join(pieces) == det.text == tok.decode(ids, skip_special=skip_special)
    return pieces


@pytest.mark.parametrize("text", TEXTS)
def test_every_prefix_matches_full_decode(tok, text):
    pieces = _check_every_prefix(tok, tok.encode(text))
    assert all("\ufffd" not in p for p in pieces)  # valid UTF-8 never shows a broken character


def test_emoji_split_across_byte_tokens(tok):
    ids = tok.encode("a😀")  # 1 + 4 byte tokens
    assert len(ids) == 5
    det = IncrementalDetokenizer(tok)
    assert [det.push([i]) for i in ids] == ["a", "", "", "", "😀"]
    det2 = IncrementalDetokenizer(tok)
    assert det2.push(ids[:3]) == "a" and det2.push(ids[3:]) == "😀"


def test_random_chunks_of_random_text(tok):
    rng = random.Random(0)
    alphabet = "ab \n漢字😀é👍🏽\u0301"
    for _ in range(100):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        ids = tok.encode(text)
        det, out, i = IncrementalDetokenizer(tok), [], 0
        while i < len(ids):
            n = rng.randint(1, 6)
            out.append(det.push(ids[i:i + n]))
            assert "\ufffd" not in out[-1]
            i += n
        out.append(det.flush())
        assert "".join(out) == text


def test_invalid_bytes_match_full_decode(tok):
    rng = random.Random(1)
    for _ in range(300):  # random bytes: lone continuations, truncated leaders, overlongs
        ids = [FIRST_BYTE_ID + rng.choice([0x41, 0x80, 0xBF, 0xC0, 0xC3, 0xE6, 0xED, 0xF0, 0xF4, 0xFF, 0x9F])
               for _ in range(rng.randint(1, 10))]
        # CPython holds a started sequence until it is complete or broken by a later byte (an ED BF
        # pair is held although BF cannot follow ED); what it releases always matches decode
        _check_every_prefix(tok, ids, max_held=3)


def test_skip_special(tok):
    ids = tok.encode("<｜begin▁of▁sentence｜>hi <think>x</think>😀<｜end▁of▁sentence｜>")
    _check_every_prefix(tok, ids, skip_special=True)
    det = IncrementalDetokenizer(tok, skip_special=True)
    det.push(ids)
    assert det.text == "hi <think>x</think>😀"
    det = IncrementalDetokenizer(tok, skip_special=False)
    det.push(ids)
    assert det.text == tok.decode(ids)


def test_cost_is_per_new_token(tok, monkeypatch):
    """Each token's bytes are looked up once; the whole text is never decoded again."""
    det = IncrementalDetokenizer(tok)
    ids = tok.encode("long history 漢字😀 " * 200)
    det.push(ids)
    calls = []
    original = tok.token_bytes
    monkeypatch.setattr(tok, "token_bytes", lambda i: calls.append(i) or original(i))
    monkeypatch.setattr(tok, "decode", lambda *a, **k: pytest.fail("whole-text decode"))
    new = tok.encode("tail😀")
    assert det.push(new) == "tail😀"
    assert calls == new


def test_rejects_a_tokenizer_without_byte_level_decoder():
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    from serving.text.tokenizer import Tokenizer

    vocab = {"<｜begin▁of▁sentence｜>": 0, "<｜end▁of▁sentence｜>": 1, "a": 2}
    word_level = Tokenizer(HFTokenizer(models.WordLevel(vocab, unk_token="a")))
    with pytest.raises(ValueError, match="needs a byte-level tokenizer"):
        IncrementalDetokenizer(word_level)
    with pytest.raises(ValueError, match="token bytes need a ByteLevel decoder"):
        word_level.token_bytes(2)
