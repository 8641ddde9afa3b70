"""One server on 2 processes x 2 CPU devices (`serving.launch`, JAX's distributed runtime, gloo): what it serves is
the exact one-device forward's, and a dead process ends the server cleanly.

DEP (dp=2 x tp=2, experts over all 4 devices) on tiny V4.1: concurrent streams, chunked prefills and a session's
prefix hit (the requests spread over both data-parallel ranks, i.e. both processes) - greedy tokens equal and their
logprobs within 1e-5 of `Model.logits` of each whole sequence (the one-process server is held to the same oracle
elsewhere; `serving.bench.multiprocess` compares the two servers directly, every model and layout). Then process 1
is killed mid-stream: the stream ends with an error event, /health answers 503 naming process 1, new requests get
503, and the launcher exits non-zero within 10 s. TP4 (experts over the 4 devices, EPLB rearranging them every 4
steps) across the 2 processes on a tiny V4 checkpoint: the same check, then SIGTERM to the launcher stops every
process with status 0. Processes started with different flags refuse to serve.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

import dsv41

from serving.bench.server_process import REPO_ROOT, free_port
from tests.conftest import CALLER_XLA_FLAGS, HANG_TIMEOUT_S, TEST_XLA_FLAGS, XLA_CACHE

pytestmark = pytest.mark.slow  # the second tier (`make test-slow`; tests/README.md)

# One token bucket (a decode pads to it): 3 programs per server. Prompts past 16 tokens are chunked prefills. Where
# a chunk ends depends on what else shares the step's 16 tokens, i.e. on the streams' arrival times, and bounded
# replay's decoder trimming depends on where chunks end; with it off every schedule computes the same rows.
FLAGS = ["--max-num-seqs", "4", "--max-num-batched-tokens", "16", "--max-model-len", "256", "--token-buckets", "16",
         "--no-swa-bounded-replay", "--no-background-compile", "--disable-access-log"]
ENV = {**os.environ, "XLA_FLAGS": f"{TEST_XLA_FLAGS} {CALLER_XLA_FLAGS}".strip(), "PYTHONPATH": str(REPO_ROOT)}
SHARED = list(range(40, 120))  # a session's prefix: 5 blocks, past the 56-token exact replay halo
PROMPTS = {"short": [5, 6, 7, 8, 9], "mid": list(range(100, 113)), "chunked": list(range(200, 237)),
           "chunked2": [7] * 21 + list(range(300, 320)), "turn1": SHARED + [11, 12, 13],
           "turn2": SHARED + [21, 22, 23, 24]}


@contextlib.contextmanager
def launched(layout: list[str], model: str, log: Path):
    """(base URL, launcher process, its log) of a 2-process server, stopped on the way out."""
    port = free_port()
    cmd = [sys.executable, "-m", "serving.launch", "--num-processes", "2", "--devices-per-process", "2", "--",
           "--model", model, "--port", str(port), "--compilation-cache-dir", str(XLA_CACHE), *layout, *FLAGS]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=ENV,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + HANG_TIMEOUT_S
        while not _healthy(url):
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "not ready"
            time.sleep(0.5)
        yield url, proc, log
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _pids(log: Path) -> dict[int, int]:
    return {int(i): int(p) for i, p in re.findall(r"process (\d+): pid (\d+)", log.read_text(errors="replace"))}


def serve_set(url: str, model: str) -> dict:
    """The fixed request set: 4 concurrent greedy streams (2 chunked prefills among them), then a session's two
    turns sharing a prefix. Request id -> (token ids, logprobs [n], top logprobs: n dicts text -> logprob, as
    OpenAI's completions give them; byte-level texts may coincide, so a dict may hold fewer than 3)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600)

    def stream(prompt: list[int], session: str | None = None, n: int = 6):
        toks, lps, tops = [], [], []
        headers = {"x-session-id": session} if session else None
        for ev in client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0, logprobs=3,
                                            stream=True, extra_body={"ignore_eos": True, "return_token_ids": True},
                                            extra_headers=headers):
            for ch in ev.choices:
                if ch.logprobs and ch.logprobs.token_logprobs:
                    toks += ch.model_extra["token_ids"]
                    lps += ch.logprobs.token_logprobs
                    tops += ch.logprobs.top_logprobs
        assert len(toks) == len(lps) == len(tops) == n
        return toks, np.array(lps), tops

    concurrent_set = {k: p for k, p in PROMPTS.items() if not k.startswith("turn")}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futs = {k: pool.submit(stream, p, f"s-{k}") for k, p in concurrent_set.items()}
        out = {k: f.result() for k, f in futs.items()}
    out["turn1"] = stream(PROMPTS["turn1"], "session-a")
    out["turn2"] = stream(PROMPTS["turn2"], "session-a")
    return out


def _assert_exact(got: dict, model, prompts: dict[str, list[int]]) -> None:
    """Greedy tokens and their logprobs are the exact one-device forward's of each whole sequence (within 1e-5:
    tensor-parallel sums differ by float32 noise). One compiled forward: every sequence padded to PAD ids at the end,
    which a causal model's earlier positions do not see."""
    for k, prompt in prompts.items():
        toks, lps, _ = got[k]
        seq = prompt + toks
        logits = model.logits(np.array(seq + [0] * (PAD - len(seq))))[len(prompt) - 1:len(seq) - 1]
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        assert toks == [int(t) for t in logp.argmax(-1)], k
        assert np.abs(lps - logp[np.arange(len(toks)), toks]).max() <= 1e-5, k


PAD = 96


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return float(re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M).group(1))


DEP = ["--data-parallel-size", "2", "--tensor-parallel-size", "2", "--enable-expert-parallel", "--block-size", "16"]


def test_dep_two_processes_serve_as_one_and_fail_cleanly(tmp_path):
    with launched(DEP, "tiny", tmp_path / "two.log") as (url, proc, log):
        got = serve_set(url, "dsv41-tiny")
        _assert_exact(got, dsv41.random_model("tiny", seed=0), PROMPTS)
        assert _metric(url, "vllm:prefix_cache_hits_total") > 0  # turn 2's prefix hit
        steps, nbytes = _metric(url, "dsv41:step_broadcasts_total"), _metric(url, "dsv41:step_broadcast_bytes_total")
        assert steps > 0 and 0 < nbytes / steps < 64_000

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
        events = client.completions.create(model="dsv41-tiny", prompt=[5, 6, 7], max_tokens=200, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        next(iter(events))  # streaming
        os.kill(_pids(log)[1], signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(openai.APIError, match="process 1 stopped answering"):
            for _ in events:
                pass
        print(f"error event {time.monotonic() - killed:.1f} s after the kill")
        health = httpx.get(url + "/health", timeout=5)
        assert health.status_code == 503 and "process 1" in health.json()["error"]["message"]
        late = httpx.post(url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, timeout=5)
        assert late.status_code == 503
        assert proc.wait(timeout=10) != 0
        print(f"launcher exited {time.monotonic() - killed:.1f} s after the kill")
        assert time.monotonic() - killed < 10


def test_tp4_ep4_with_eplb_across_processes_on_v4_and_sigterm_stops_every_process(tmp_path):
    from serving.bench import make_checkpoints
    assert make_checkpoints.main([str(tmp_path / "ckpt"), "--size", "tiny", "--dtype", "float32"]) == 0
    model = str(tmp_path / "ckpt" / "v4")
    # attention over 4 heads' shards, the experts over 4 ranks, rearranged every 4 steps (the other process
    # migrates its shards between the same two steps, or its experts' outputs would not match)
    tp4 = ["--tensor-parallel-size", "4", "--enable-expert-parallel", "--enable-eplb", "--eplb-step-interval", "4",
           "--eplb-window-size", "4"]
    with launched(tp4, model, tmp_path / "two.log") as (url, proc, log):
        _assert_exact(serve_set(url, "v4"), dsv41.load(model, dtype="float32"), PROMPTS)
        assert _metric(url, "dsv41:eplb_rebalances_total") > 0
        pids = _pids(log)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        for pid in pids.values():
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)


def test_processes_started_with_different_flags_refuse_to_serve(tmp_path):
    """Before loading anything: the processes compare their settings, and a difference names the flag."""
    addr = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, "-m", "serving.server", "--model", "tiny", "--nnodes", "2",
                               "--node-rank", str(rank), "--dist-init-addr", addr, "--num-cpu-devices", "2",
                               "--tensor-parallel-size", "4", "--max-num-seqs", str(seqs), "--port",
                               str(free_port())], cwd=REPO_ROOT, env=ENV, stderr=subprocess.PIPE, text=True)
             for rank, seqs in ((0, 8), (1, 16))]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert all(p.returncode != 0 for p in procs)
    assert any("--max-num-seqs 16 here, 8 on process 0" in e or "--max-num-seqs 8 here, 16 on process 1" in e
               for e in errors), errors
