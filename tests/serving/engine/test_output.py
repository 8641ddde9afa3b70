"""Finish decisions and streamed text (no model), split as in the engine: the output state finds stop strings in a
step's text, the scheduler appends the tokens and decides every finish (EOS / stop token id / stop string / length),
the output state reports the text. Stop strings never leak into a stream, whatever the token boundaries; EOS / stop
token ids respect min_tokens and ignore_eos; length limits."""

import random

import pytest

import dsv41
from serving.engine.output import OutputState
from serving.engine.request import Request, StopString
from serving.engine.scheduler import Scheduler, SchedulerConfig
from serving.runtime.block_manager import BlockManager
from serving.runtime.config import RuntimeConfig
from serving.runtime.sampling_params import SamplingParams
from serving.text.tokenizer import byte_level_tokenizer

TOK = byte_level_tokenizer(512)


def _run(text_ids, max_model_len=10_000, **params):
    """Feed `text_ids` as the sampled tokens of one request, one decode step each, the way the engine does (stop
    strings are looked for before the scheduler's postprocess)."""
    req = Request("r", [TOK.bos_id], SamplingParams(**{"temperature": 0, "max_tokens": 1000, **params}),
                  eos_id=TOK.eos_id)
    rc = RuntimeConfig(max_num_seqs=1, max_num_batched_tokens=8, max_model_len=max_model_len)
    sched = Scheduler(SchedulerConfig(), rc, dsv41.ModelConfig.preset("tiny"), BlockManager(64, 8))
    sched.add(req)
    st = OutputState(req, TOK)
    pieces = []
    for t in text_ids:
        (step,) = sched.schedule()
        finish = sched.postprocess(step, t, stop=st.find_stop([t]) if req.params.stop else None)
        pieces.append(st.update(t, finish))
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


def test_a_stop_string_longer_than_a_token_pair_is_found():
    """Four characters over four one-byte tokens: the held-back tail keeps every character that may still start the
    stop string (it once kept fewer while the text was shorter than the hold, and streamed the start of it)."""
    pieces, reason, stop_reason, _ = _run(TOK.encode("xx abcd tail"), stop=["abcd"])
    assert (reason, stop_reason, "".join(pieces)) == ("stop", "abcd", "xx ")


def _spec_step(emitted: str, **params):
    """One request through the engine's order of calls: a prefill step samples "x", then a step verifying drafts
    emits the tokens of `emitted` (the accepted drafts and the bonus token): stop strings looked for in the step's
    text, the scheduler's postprocess, the text reported. Returns the scheduler, the request, the second step's
    finish and the streamed text."""
    req = Request("r", [TOK.bos_id, 5, 6], SamplingParams(**{"temperature": 0, "max_tokens": 1000, **params}),
                  eos_id=TOK.eos_id)
    rc = RuntimeConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=10_000)
    sched = Scheduler(SchedulerConfig(), rc, dsv41.ModelConfig.preset("tiny"), BlockManager(8, 4))
    sched.add(req)
    st = OutputState(req, TOK)
    text, finish = "", None
    for toks in (TOK.encode("x"), TOK.encode(emitted)):
        req.draft_ids = toks[:-1]
        (step,) = sched.schedule()
        assert step.num_draft == len(toks) - 1
        before = req.num_tokens
        finish = sched.postprocess(step, toks, stop=st.find_stop(toks) if req.params.stop else None)
        new = req.token_ids[before:]
        text += "".join(st.update(t, finish if j == len(new) - 1 else None) for j, t in enumerate(new))
    return sched, req, finish, text


def test_a_stop_string_inside_a_speculative_step_ends_the_request_once_in_the_scheduler():
    """The stop string ends at the step's third token of six: the scheduler appends only up to it, finishes the
    request and frees its blocks and slot - once: a later removal (an abort arriving after the finish) frees
    nothing twice."""
    sched, req, finish, text = _spec_step("aSTOPb", stop=["ST"])
    assert finish == ("stop", "ST") and req.output_ids == TOK.encode("xaST") and text == "xa"
    assert req.finished and sched.running == [] and sched.free_slots == [1, 0]
    assert sched.blocks.num_free_blocks == 8
    sched.remove(req)
    assert sched.free_slots == [1, 0] and sched.blocks.num_free_blocks == 8
    *_, text = _spec_step("aSTOPb", stop=["ST"], include_stop_str_in_output=True)
    assert text == "xaST"


def test_within_a_step_the_first_finish_in_token_order_wins():
    """A stop string and a stop token id in one speculative step: whichever token comes first ends the request;
    at the same token the stop id does (its text is not emitted), and a stop string wins over the length limit."""
    b, t = TOK.encode("b")[0], TOK.encode("T")[0]
    _, req, finish, text = _spec_step("aSTb", stop=["ST"], stop_token_ids=[b])
    assert (finish, req.output_ids, text) == (("stop", "ST"), TOK.encode("xaST"), "xa")
    _, req, finish, text = _spec_step("abST", stop=["ST"], stop_token_ids=[b])
    assert (finish, req.output_ids, text) == (("stop", b), TOK.encode("xab"), "xa")
    _, req, finish, text = _spec_step("aSTb", stop=["ST"], stop_token_ids=[t])
    assert (finish, req.output_ids, text) == (("stop", t), TOK.encode("xaST"), "xaS")
    _, req, finish, text = _spec_step("aST", stop=["ST"], max_tokens=4)  # drafts stop at the limit
    assert (finish, req.output_ids, text) == (("stop", "ST"), TOK.encode("xaST"), "xa")


def test_find_stop_names_the_token_and_the_earliest_starting_string():
    req = Request("r", [TOK.bos_id], SamplingParams(stop=["cd", "bcd"]), eos_id=TOK.eos_id)
    st = OutputState(req, TOK)
    assert st.find_stop(TOK.encode("ab")) is None
    assert st.update(TOK.encode("a")[0], None) + st.update(TOK.encode("b")[0], None) == ""  # "ab" may start "bcd"
    assert st.find_stop(TOK.encode("cdef")) == StopString(1, "bcd")  # both complete at "d": "bcd" starts first
