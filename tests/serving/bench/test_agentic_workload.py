"""The agentic session-tree generator: deterministic per seed, block-aligned growth, subagents that can gate,
capped think time, unique cache-bust markers, and the theoretical hit rate against hand counts."""

import dataclasses

import pytest

from serving.bench import agentic_workload as aw
from serving.bench.agentic_workload import AgenticConfig

SMALL = AgenticConfig(block_size=8, system_prompt_len=16, marker_len=3, task_len=5, max_context=512)


def _all_turns(tree):
    return [t for c in tree.conversations() for t in c.turns]


def test_same_seed_same_trees_other_seed_or_salt_other_trees():
    a = aw.session_trees(SMALL, seed=3, num=6)
    assert a == aw.session_trees(SMALL, seed=3, num=6)
    assert aw.session_tree(SMALL, 3, 4) == a[4]  # a tree does not depend on the others generated
    b = aw.session_trees(SMALL, seed=4, num=6)
    assert [t.root.turns for t in a] != [t.root.turns for t in b]
    salted = aw.session_trees(SMALL, seed=3, num=6, salt=1)
    # a salt changes the marker only: same shape, different prompts, different session ids
    for x, y in zip(a, salted):
        assert [t.prompt_len for t in _all_turns(x)] == [t.prompt_len for t in _all_turns(y)]
        assert x.root.turns[0].prompt_ids != y.root.turns[0].prompt_ids and x.session_id != y.session_id


def test_prompts_grow_by_block_aligned_deltas_and_fit_the_context():
    cfg = SMALL
    trees = aw.session_trees(cfg, seed=0, num=40)
    grew = 0
    for tree in trees:
        for conv in tree.conversations():
            lens = [t.prompt_len for t in conv.turns]
            assert lens[0] == cfg.first_prompt_len() and lens[0] % cfg.block_size == 0
            for prev, nxt in zip(conv.turns, conv.turns[1:]):
                delta = nxt.prompt_len - prev.prompt_len
                assert delta > 0 and delta % cfg.block_size == 0
                # the new turn re-sends the old prompt, then the recorded reply (as long as max_tokens), then the tool result
                assert nxt.prompt_ids[:prev.prompt_len] == prev.prompt_ids
                assert len(nxt.messages[-2][1]) == prev.output_len and nxt.messages[-2][0] == "assistant"
                assert nxt.messages[-1][0] == "user" and len(nxt.messages[-1][1]) >= cfg.block_size
                grew += 1
            assert all(t.prompt_len + t.output_len <= cfg.max_context for t in conv.turns)
            assert all(1 <= t.output_len <= cfg.max_output for t in conv.turns)
            assert len(conv.turns) <= cfg.max_turns
    assert grew > 50


def test_turn_counts_are_heavy_tailed_around_the_median_and_capped():
    cfg = dataclasses.replace(SMALL, turns_median=6, turns_sigma=1.0, max_turns=30, max_context=100_000,
                              subagent_prob=0.0)
    turns = sorted(len(t.root.turns) for t in aw.session_trees(cfg, seed=1, num=300))
    assert 4 <= turns[150] <= 8
    assert turns[-1] == 30 and turns[0] == 1  # the cap and the floor are both reached
    assert turns[270] >= 2.5 * turns[150]  # P90 well above the median: a long tail


def test_subagents_fresh_context_gating_and_think_time_cap():
    cfg = dataclasses.replace(SMALL, subagent_prob=1.0, gating_fraction=0.5, think_median_s=1.0,
                              think_sigma=2.0, think_cap_s=1.5)
    trees = aw.session_trees(cfg, seed=2, num=60)
    subs = [(t, s) for t in trees for s in t.root.subagents]
    assert {s.gating for _, s in subs} == {True, False}
    system = aw.system_prompt(cfg, 2)
    for tree, s in subs:
        n_root = len(tree.root.turns)
        assert 0 <= s.after_turn < n_root - 1  # there is a next parent turn to gate
        first = s.conversation.turns[0].prompt_ids
        root0 = tree.root.turns[0].prompt_ids
        head = cfg.system_prompt_len + cfg.marker_len
        assert first[:head] == root0[:head] and first[:cfg.system_prompt_len] == list(system)  # shared head
        assert first[head:] != root0[head:]  # its own task: a fresh context
        assert s.conversation.conversation_id.startswith(tree.session_id + ".sub")
    assert all(len(t.root.turns) < 2 or t.root.subagents for t in trees)  # probability 1
    thinks = [x for t in trees for c in t.conversations() for x in c.think_s[1:]]
    assert max(thinks) == pytest.approx(1.5) and min(thinks) < 1.0
    assert all(c.think_s[0] == 0.0 for t in trees for c in t.conversations())
    assert all(1 <= t.warm_start_turn < len(t.root.turns) for t in trees if len(t.root.turns) >= 2)


def test_cache_bust_markers_separate_trees_and_system_prompt_sharing_is_a_choice():
    cfg = dataclasses.replace(SMALL, subagent_prob=0.0)
    trees = aw.session_trees(cfg, seed=0, num=30)
    markers = {tuple(t.root.turns[0].prompt_ids[16:19]) for t in trees}
    assert len(markers) == 30
    assert aw.cache_bust_marker(cfg, 5, 0) != aw.cache_bust_marker(cfg, 5, 1)
    assert all(t.root.turns[0].prompt_ids[:16] == trees[0].root.turns[0].prompt_ids[:16] for t in trees)
    unshared = aw.session_trees(dataclasses.replace(cfg, shared_system_prompt=False), seed=0, num=30)
    assert len({t.root.turns[0].prompt_ids[0:3][0] for t in unshared[:20]}) > 1  # the marker leads
    # no two trees share even their first block
    assert len({tuple(t.root.turns[0].prompt_ids[:8]) for t in unshared}) == 30
    with pytest.raises(ValueError, match="does not fit in the cache-bust marker"):
        aw.cache_bust_marker(dataclasses.replace(cfg, token_id_range=(10, 12)), 100, 0)


def test_block_reuse_hand_counts():
    B = 4
    a = list(range(100, 108))            # 2 blocks
    b = a + list(range(200, 206))        # a, then 6 more: blocks 0, 1 re-sent, block 2 new, 2 tokens partial
    c = list(range(100, 104)) + [9] * 8  # block 0 re-sent; its block 1 differs, so block 2 is new too
    d = list(a)                          # a again: only block 0 servable (the last token is always computed)
    assert aw.block_reuse([a], B) == (0, 8)
    assert aw.block_reuse([a, b], B) == (8, 22)
    assert aw.block_reuse([a, b, c], B) == (12, 34)
    assert aw.block_reuse([a, b, c, d], B) == (16, 42)
    seen = set()
    aw.block_reuse([a], B, seen)  # a warm-up primes the cache
    assert aw.block_reuse([b], B, seen) == (8, 14)


def test_theoretical_hit_rate_of_generated_trees_equals_a_hand_count():
    # no subagents: turn t re-sends turn t-1's whole (block-aligned) prompt; tree 2 re-sends the shared
    # system prompt's whole blocks (16 tokens = 2 blocks of 8), and nothing else of tree 1
    cfg = dataclasses.replace(SMALL, subagent_prob=0.0)
    trees = aw.session_trees(cfg, seed=7, num=2)
    sent = sum(t.prompt_len for tree in trees for t in tree.root.turns)
    reused = sum(t.prompt_len for tree in trees for t in tree.root.turns[:-1]) + 16
    assert aw.theoretical_hit_rate(trees, cfg.block_size) == pytest.approx(reused / sent)
    unshared = dataclasses.replace(cfg, shared_system_prompt=False)
    trees = aw.session_trees(unshared, seed=7, num=2)
    sent = sum(t.prompt_len for tree in trees for t in tree.root.turns)
    reused = sum(t.prompt_len for tree in trees for t in tree.root.turns[:-1])
    assert aw.theoretical_hit_rate(trees, cfg.block_size) == pytest.approx(reused / sent)


def test_bad_config_is_named():
    with pytest.raises(ValueError, match="gating_fraction"):
        AgenticConfig(gating_fraction=1.5)
    with pytest.raises(ValueError, match="max_context 100 cannot hold a first prompt"):
        AgenticConfig(max_context=100)
    with pytest.raises(ValueError, match="token_id_range"):
        AgenticConfig(token_id_range=(5, 5))
    with pytest.raises(ValueError, match="turns_median"):
        AgenticConfig(turns_median=0)
