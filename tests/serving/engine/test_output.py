"""Finish decisions and streamed text (no model), split as in the engine: the scheduler appends each token
and decides EOS / stop token id / length finishes, the output state turns tokens into text and finds stop
strings. Stop strings never leak into a stream, whatever the token boundaries; EOS / stop token ids respect
min_tokens and ignore_eos; length limits."""

import random

import pytest

import dsv41
from serving.engine.output import OutputState
from serving.engine.request import Finish, Request
from serving.engine.scheduler import Scheduler, SchedulerConfig
from serving.runtime.block_manager import BlockManager
from serving.runtime.config import RuntimeConfig
from serving.runtime.sampling_params import SamplingParams
from serving.text.tokenizer import byte_level_tokenizer

TOK = byte_level_tokenizer(512)


def _run(text_ids, max_model_len=10_000, **params):
    """Feed `text_ids` as the sampled tokens of one request, one decode step each, the way the engine does."""
    req = Request("r", [TOK.bos_id], SamplingParams(**{"temperature": 0, "max_tokens": 1000, **params}),
                  eos_id=TOK.eos_id)
    rc = RuntimeConfig(max_num_seqs=1, max_num_batched_tokens=8, max_model_len=max_model_len)
    sched = Scheduler(SchedulerConfig(), rc, dsv41.ModelConfig.preset("tiny"), BlockManager(64, 8))
    sched.add(req)
    st = OutputState(req, TOK)
    pieces = []
    for t in text_ids:
        (step,) = sched.schedule()
        finish = sched.postprocess(step, t)
        text, stop_string = st.update(t, finish)
        if stop_string is not None:
            finish = Finish("stop", stop_string)
        pieces.append(text)
        if finish:
            return pieces, finish.reason, finish.stop_reason, req
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
