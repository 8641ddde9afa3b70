"""The runtime's per-expert token counts (EPLB's load signal) equal the counts of the model's own router on
the rows each step computed: a chunked prefill of two requests padded up to the step bucket, then decode
steps. The oracle is the full-sequence forward with the router's choices captured, so padding, the
segment split (layers before / after the CED cut) and the layer order are all checked."""

import jax
import numpy as np
import pytest

import dsv41
from dsv41.layers.moe import Router
from dsv41.model import forward
from serving.runtime.batch import SeqChunk
from serving.runtime.config import RuntimeConfig
from serving.runtime.runner import Runner
from serving.runtime.sampling_params import SamplingParams

BLOCK = 8


@pytest.fixture(scope="module")
def model():
    return dsv41.random_model("tiny", seed=5)


def _router_choices(model, tokens: list[int]) -> np.ndarray:
    """[L, T, k] expert ids the router picks for every position of the full-sequence forward (causal: a
    position's choices do not depend on the tokens after it)."""
    captured = []
    route = Router.__call__

    def spy(self, x_TD, ids_T):
        sel, weights = route(self, x_TD, ids_T)
        captured.append(sel)
        return sel, weights

    ids = np.asarray(tokens)
    h = model.engram_hashes(ids)
    Router.__call__ = spy
    try:
        sels = jax.jit(lambda i, hh: (forward(model.module, i, hh), captured)[1])(ids, h)
    finally:
        Router.__call__ = route
    return np.stack([np.asarray(s) for s in sels])


def test_step_counts_equal_router_counts(model):
    c = model.config
    rc = RuntimeConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=48, block_size=BLOCK,
                       token_buckets=(32,), swa_bounded_replay=False)
    runner = Runner(model, rc, progress=False, expert_counts=True)
    runner.compiler.precompile()
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, c.vocab_size - 1, n)] for n in (13, 6)]
    tables = [list(range(6)), list(range(6, 12))]
    greedy = SamplingParams(temperature=0)
    # (start, end) per request per step: a prefill of 10 + 6 rows, a second prefill chunk beside a decode row,
    # then decode steps; every step is padded up to the 32-row bucket
    schedule = [[(0, 10), (0, 6)], [(10, 13), (6, 7)], [(13, 14), (7, 8)], [(14, 15), (8, 9)]]
    tokens = [list(p) for p in prompts]
    computed = []
    for step in schedule:
        chunks = []
        for i, (start, end) in enumerate(step):
            chunks.append(SeqChunk(slot=i, block_table=tables[i], token_ids=tokens[i][:end], start=start, end=end,
                                   sample=end >= len(prompts[i])))
        out = runner.step(chunks, [greedy] * len(chunks))
        for i, ch in enumerate(chunks):
            if ch.sample and ch.end == len(tokens[i]):
                tokens[i].append(int(out.tokens[i]))
        computed.append(out.expert_counts)
    # one oracle trace: both requests' final tokens, the shorter padded with a token after its own
    n = max(len(t) for t in tokens)
    sel = [_router_choices(model, t + [3] * (n - len(t))) for t in tokens]  # [L, n, k] each
    for step, got in zip(schedule, computed):
        want = np.zeros((c.num_hidden_layers, c.n_routed_experts), np.int64)
        for i, (start, end) in enumerate(step):
            for l in range(c.num_hidden_layers):
                want[l] += np.bincount(sel[i][l, start:end].reshape(-1), minlength=c.n_routed_experts)
        rows = sum(end - start for start, end in step)
        assert got.shape == want.shape and got.dtype == np.int32
        assert (got.sum(axis=1) == rows * c.num_experts_per_tok).all()  # padding rows count nothing
        np.testing.assert_array_equal(got, want)

