"""Training is a function of its config: same seed -> the same losses, another seed -> others; a run resumed
from its Orbax checkpoint repeats the uninterrupted one; the training forward computes `model.forward`'s
logits and the drafter batch computes `draft_hidden`. A 3-layer cut of the tiny preset keeps compiling short."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.slow  # the second tier (`make test-slow`; tests/README.md)

pytest.importorskip("optax", reason="training needs the train extra: pip install -e '.[train]'")

from dsv41.config import ModelConfig
from dsv41.dspark import draft_hidden
from dsv41.layers.attention import masked_attention
from dsv41.model import forward, window_mask
from dsv41.train.config import TrainConfig
from dsv41.train.drafter import draft_hidden_batch
from dsv41.train.forward import backbone_forward, window_attention
from dsv41.train.loop import Progress, Trainer

# SWA-only + Engram, ratio-2 KV/index source (Engram), ratio-1 cut; one DSpark stage reading all three.
MICRO = ModelConfig.preset("tiny").replace(
    num_hidden_layers=3, compress_ratios=(0, 2, 1), kv_source_layer_ids=(1, 2), index_source_layer_ids=(1, 2),
    candidate_source_layer_id=None, engram_layer_ids=(1,), engram_num_embeddings=(434,),
    dspark_target_layer_ids=(0, 1, 2), hc_sinkhorn_iters=3)
TC = TrainConfig(seq_len=24, batch_size=2, backbone_steps=2, dspark_steps=1, dspark_anchors=4, warmup_steps=1,
                 eval_windows=0, checkpoint_every=1)
CORPUS = np.random.default_rng(0).integers(3, MICRO.vocab_size, 4000).astype(np.uint16)


class _Quiet(Progress):
    def update(self, *a, **k):
        pass

    def line(self, text):
        pass


def _run(out, tc=TC, stop_at=None):
    t = Trainer(MICRO, tc, CORPUS, CORPUS[:200], out, progress=_Quiet())
    state = t.run(stop_at=stop_at)
    return [(r["phase"], r["loss"]) for r in t.history], state


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("ref"))


def test_same_seed_same_losses_other_seed_other_losses(reference_run, tmp_path):
    losses, state = reference_run
    assert [p for p, _ in losses] == ["backbone", "backbone", "dspark"] and all(np.isfinite(v) for _, v in losses)
    again, state2 = _run(tmp_path / "again")
    assert again == losses
    for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(state2["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    other, _ = _run(tmp_path / "other", TrainConfig(**{**TC.__dict__, "seed": 1}))
    assert all(a[1] != b[1] for a, b in zip(other, losses))


def test_resume_from_checkpoint_repeats_the_uninterrupted_run(reference_run, tmp_path):
    losses, state = reference_run
    first, _ = _run(tmp_path, stop_at=1)
    assert first == losses[:1] and (tmp_path / "checkpoints" / "1").is_dir()
    rest, resumed = _run(tmp_path)  # a new Trainer on the same folder restores step 1
    assert first + rest == losses
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="learning_rate"):
        _run(tmp_path, TrainConfig(**{**TC.__dict__, "learning_rate": 1e-4}))


def test_the_drafter_trains_on_the_windows_dspark_data_names(reference_run, tmp_path):
    """With `dspark_data` the backbone steps still read the corpus (the reference run's losses) and the DSpark step
    draws its batch from the file's windows (another loss), a function of (seed, step); a file of another window
    length or without BOS first is refused, naming the field."""
    from dsv41.train.data import DataError, Rows

    rng = np.random.default_rng(4)
    rows = np.concatenate([np.full((6, 1), MICRO.bos_token_id), rng.integers(3, MICRO.vocab_size, (6, TC.seq_len))],
                          axis=1).astype(np.int32)
    np.save(tmp_path / "rows.npy", rows)
    losses, _ = reference_run
    got, _ = _run(tmp_path / "run", TrainConfig(**{**TC.__dict__, "dspark_data": str(tmp_path / "rows.npy")}))
    assert got[:2] == losses[:2] and got[2][0] == "dspark" and got[2][1] != losses[2][1]
    drawn = Rows.load(tmp_path / "rows.npy", TC.seq_len, 3, 0, MICRO.bos_token_id, MICRO.vocab_size)
    assert all(any((r == rows).all(axis=1)) for r in drawn.batch_at(7))
    np.testing.assert_array_equal(drawn.batch_at(7), drawn.batch_at(7))
    for name, bad in (("short", rows[:, :-1]), ("no_bos", np.roll(rows, 1, axis=1))):
        np.save(tmp_path / f"{name}.npy", bad)
        with pytest.raises(DataError, match="dspark_data"):
            _run(tmp_path / name, TrainConfig(**{**TC.__dict__, "dspark_data": str(tmp_path / f"{name}.npy")}))


def test_window_attention_is_masked_attention():
    rng = np.random.default_rng(1)
    T, H, d, N, W = 37, 2, 8, 18, 8
    q, kv, rows = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((T, H, d), (T, d), (N, d)))
    idx = np.sort(rng.integers(-1, N, (T, 4)), axis=1)
    idx = np.where(np.arange(4) == 0, idx, np.where(idx == np.roll(idx, 1, axis=1), -1, idx))  # unique ids
    mask = np.zeros((T, N), bool)
    for t in range(T):
        mask[t, idx[t][idx[t] >= 0]] = True
    sink = jnp.asarray(rng.standard_normal(H), jnp.float32)
    ref = jax.jit(masked_attention)(q, kv, window_mask(jnp.arange(T), W), sink, rows, jnp.asarray(mask))
    got = jax.jit(window_attention, static_argnums=3)(q, kv, sink, W, rows, jnp.asarray(idx, jnp.int32))
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-6)


def test_training_forward_is_the_model_forward(reference_run):
    """Logits of the trained micro model: the exact forward vs the banded/gathered training forward, at
    T = 20 > window 8 with index_topk 4 < visible rows (top-k cuts)."""
    from dsv41.train.loop import _graph, _merge

    _, state = reference_run
    graphdef, paths, _ = _graph(MICRO)
    model = _merge(graphdef, paths, *state["params"].values())
    t = Trainer(MICRO, TC, CORPUS, CORPUS[:200], "/unused", progress=_Quiet())
    ids = CORPUS[:21].astype(np.int32)
    hashes = jnp.asarray(t.hashes(ids[None])[0])
    ref = jax.jit(lambda i, h: forward(model, i, h))(ids[:-1], hashes)
    out = jax.jit(lambda i, tg, h: backbone_forward(model, i, tg, h))(ids[:-1], ids[1:], hashes)
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref), atol=1e-4)
    # the drafter batched over anchors = draft_hidden one block at a time
    anchors = jnp.asarray([3, 9, 15], jnp.int32)
    h_batch, _, _ = jax.jit(lambda a: draft_hidden_batch(model, ids[:-1], out.features, a))(anchors)
    ctx = model.dspark.context_kv(model.dspark.combine(out.features), jnp.arange(20))
    for i, p in enumerate(np.asarray(anchors)):
        block = jnp.asarray([ids[p]] + [MICRO.dspark_noise_token_id] * (MICRO.dspark_block_size - 1))
        h = draft_hidden(model.dspark, model.embed, block, jnp.asarray(p), ctx, jnp.arange(20))
        np.testing.assert_allclose(np.asarray(h_batch[i]), np.asarray(h), atol=1e-4)
