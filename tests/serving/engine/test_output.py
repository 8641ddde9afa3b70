"""Finish decisions and streamed text (no model): stop strings never leak into a stream, whatever the token
boundaries; EOS / stop token ids respect min_tokens and ignore_eos; length limits."""

import random

import pytest

from serving.text.tokenizer import byte_level_tokenizer
from serving.engine.output import OutputState
from serving.engine.request import Request
from serving.runtime.sampling_params import SamplingParams

TOK = byte_level_tokenizer(512)


def _run(text_ids, max_model_len=10_000, **params):
    req = Request("r", [TOK.bos_id], SamplingParams(**{"temperature": 0, "max_tokens": 1000, **params}),
                  eos_id=TOK.eos_id)
    st = OutputState(req, TOK, max_model_len)
    pieces = []
    for t in text_ids:
        text, reason, stop_reason = st.append(t)
        pieces.append(text)
        if reason:
            return pieces, reason, stop_reason, req
    return pieces, None, None, req


@pytest.mark.parametrize("seed", range(5))
def test_stop_strings_are_cut_and_never_streamed(seed):
    rng = random.Random(seed)
    body = "".join(rng.choice("ab😀c dé") for _ in range(40))
    stop = body[15:18]
    ids = TOK.encode(body + "tail")
    pieces, reason, stop_reason, _ = _run(ids, stop=[stop, "zzz"])
    streamed = "".join(pieces)
    assert (reason, stop_reason) == ("stop", stop)
    assert streamed == body[: body.find(stop)]
    pieces, *_ = _run(ids, stop=[stop], include_stop_str_in_output=True)
    assert "".join(pieces) == body[: body.find(stop) + len(stop)]


def test_text_without_stop_streams_everything_and_utf8_is_never_split():
    body = "héllo 😀 wörld 中文"
    pieces, reason, _, req = _run(TOK.encode(body), max_tokens=len(TOK.encode(body)))
    assert reason == "length" and "".join(pieces) == body
    assert all("\ufffd" not in p for p in pieces)
    assert req.num_output == len(TOK.encode(body))


def test_eos_and_stop_token_ids_respect_min_tokens_and_ignore_eos():
    a = TOK.encode("abc")
    _, reason, stop_reason, req = _run(a + [TOK.eos_id] + a)
    assert (reason, stop_reason, req.num_output) == ("stop", None, 4)
    _, reason, _, req = _run([TOK.eos_id] * 3 + a, min_tokens=3)  # EOS ignored while n <= min_tokens
    assert reason is None and req.num_output == 6
    _, reason, _, req = _run(a + [TOK.eos_id] + a, ignore_eos=True)
    assert reason is None and req.num_output == 7
    pieces, reason, stop_reason, _ = _run(a + [a[1]] + a, stop_token_ids=[a[1]], min_tokens=2)
    assert (reason, stop_reason, "".join(pieces)) == ("stop", a[1], "abc")  # the first b (n=2) is within min_tokens


def test_length_limits():
    a = TOK.encode("abcdefgh")
    _, reason, _, req = _run(a, max_tokens=3)
    assert (reason, req.num_output) == ("length", 3)
    _, reason, _, req = _run(a, max_model_len=5)  # 1 prompt token + 4 outputs reach the model length
    assert (reason, req.num_output) == ("length", 4)
