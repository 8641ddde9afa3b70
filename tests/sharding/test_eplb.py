"""EPLB: the sliding window and interval, balancedness on skewed (Zipf) and uniform routing, the packing
invariants, separate target / draft states, and the exported metrics."""

import numpy as np
import pytest

from sharding.eplb import EplbConfig, EplbState, balancedness, identity_placement, rebalance

L, E, RANKS, TOKENS, K = 4, 32, 8, 512, 2


def _routing_counts(rng, probs_LE, tokens=TOKENS, k=K):
    """Counts of one step: every token picks k distinct experts with the layer's probabilities."""
    out = np.zeros(probs_LE.shape, np.int64)
    for l, p in enumerate(probs_LE):
        g = rng.gumbel(size=(tokens, len(p))) + np.log(p)  # k distinct draws without replacement
        np.add.at(out[l], np.argpartition(-g, k, axis=1)[:, :k].reshape(-1), 1)
    return out


def _zipf(s, n_layers=L, n_experts=E, seed=0):
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, n_experts + 1) ** s
    return np.stack([rng.permutation(p / p.sum()) for _ in range(n_layers)])


def _run(probs, cfg, steps, seed=1):
    st = EplbState("target", probs.shape[0], probs.shape[1], RANKS, cfg)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        st.record(_routing_counts(rng, probs))
        st.step()
    return st


def test_zipf_rebalanced_and_uniform_control():
    cfg = EplbConfig(eplb_window_size=8, eplb_step_interval=10, eplb_num_redundant_experts=16)
    skew = _run(_zipf(1.5), cfg, 10)
    uniform = _run(np.full((L, E), 1.0 / E), cfg, 10)
    print(f"\nZipf 1.5: {skew.last_balancedness_before:.3f} -> {skew.last_balancedness_after:.3f}; "
          f"uniform: {uniform.last_balancedness_before:.3f} -> {uniform.last_balancedness_after:.3f}")
    assert skew.rearrangements == 1
    assert skew.last_balancedness_before < 0.4
    assert skew.last_balancedness_after >= 0.94
    assert uniform.last_balancedness_after >= 0.94
    # the placement measured on fresh steps of the same distribution stays balanced (not fitted to noise)
    fresh = _routing_counts(np.random.default_rng(7), _zipf(1.5))
    assert balancedness(fresh, skew.placement) >= 0.9


def test_window_and_interval():
    cfg = EplbConfig(eplb_window_size=3, eplb_step_interval=5)
    st = EplbState("target", 1, 8, 4, cfg)
    for i in range(4):
        st.record(np.full((1, 8), i + 1))
        assert st.step() is None
    assert st.window_load()[0, 0] == 2 + 3 + 4  # only the last 3 steps
    st.record(np.eye(1, 8, 0, dtype=np.int64) * 100)
    assert st.step() is not None and st.rearrangements == 1


def test_placement_invariants():
    rng = np.random.default_rng(3)
    load = rng.zipf(1.5, size=(3, 16)).astype(float)
    p = rebalance(load, 4, 8)
    assert p.phys_to_log.shape == (3, 24)
    table, count = p.replicas()
    for l in range(3):
        assert set(p.phys_to_log[l]) == set(range(16))  # every logical expert keeps a slot
        assert count[l].sum() == 24
        for e in range(16):
            assert all(p.phys_to_log[l, s] == e for s in table[l, e, : count[l, e]])
    # per-rank loads conserve the total
    assert np.allclose(p.rank_loads(load).sum(axis=1), load.sum(axis=1))
    with pytest.raises(ValueError, match="num_redundant_experts"):
        identity_placement(1, 16, 5, 2)


def test_draft_state_is_separate():
    cfg = EplbConfig(eplb_window_size=4, eplb_step_interval=4, eplb_num_redundant_experts=8)
    target = EplbState("target", L, E, RANKS, cfg)
    draft = EplbState("draft", 1, 16, RANKS, cfg)
    rng = np.random.default_rng(0)
    for _ in range(4):
        target.record(_routing_counts(rng, _zipf(1.5)))
        draft.record(_routing_counts(rng, _zipf(1.5, 1, 16), k=2))
        target.step(), draft.step()
    assert target.placement.phys_to_log.shape == (L, E + 8) and draft.placement.phys_to_log.shape == (1, 24)
    assert target.rearrangements == 1 and draft.rearrangements == 1
    assert draft.last_balancedness_after > draft.last_balancedness_before
    with pytest.raises(ValueError, match="draft"):
        draft.record(np.zeros((L, E)))
