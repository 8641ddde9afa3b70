"""DSpark drafter modules: loaded from `mtp.*`, fed by the target's layer-input features, non-causal
inside a proposal block, windowed over the context."""

import jax.numpy as jnp
import numpy as np

import dsv41
from dsv41.dspark import draft_base_logits, draft_hidden
from dsv41.model import forward_hidden


def test_dspark_draft_block():
    m = dsv41.random_model("tiny", seed=11)
    c = m.config
    mod = m.module
    ids = jnp.asarray(np.random.default_rng(0).integers(3, 512, 20))
    _, feats = forward_hidden(mod, ids, jnp.asarray(m.engram_hashes(np.asarray(ids))),
                              capture=c.dspark_target_layer_ids)
    assert sorted(feats) == list(c.dspark_target_layer_ids)
    main_x = mod.dspark.combine(jnp.stack([feats[k] for k in c.dspark_target_layer_ids], axis=1))
    ctx = mod.dspark.context_kv(main_x, jnp.arange(20))
    block = jnp.asarray([int(ids[-1])] + [c.dspark_noise_token_id] * (c.dspark_block_size - 1))
    h = draft_hidden(mod.dspark, mod.embed, block, jnp.asarray(20), ctx, jnp.arange(20))
    logits = draft_base_logits(mod.dspark, mod.head, h)
    assert logits.shape == (c.dspark_block_size, c.vocab_size) and np.isfinite(np.asarray(logits)).all()
    # Non-causal inside the block: the last slot's token changes slot 0.
    h2 = draft_hidden(mod.dspark, mod.embed, block.at[-1].set(7), jnp.asarray(20), ctx, jnp.arange(20))
    assert np.abs(np.asarray(h2[0] - h[0])).max() > 1e-4
    # Context rows older than the window are invisible.
    old = [k.at[:20 - c.sliding_window].set(0.0) for k in ctx]
    h3 = draft_hidden(mod.dspark, mod.embed, block, jnp.asarray(20), old, jnp.arange(20))
    np.testing.assert_allclose(np.asarray(h3), np.asarray(h), atol=1e-6)
    e, bias = mod.dspark.markov_bias(block[:1])
    assert bias.shape == (1, c.vocab_size)
    assert 0 < float(mod.dspark.confidence_prob(h[0], e[0])) < 1
