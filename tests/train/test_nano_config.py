"""The nano preset keeps every role of the full V4.1 model at small width, and its window and context make
both SWA bounded replays cut real rows for a 1K-token prompt."""

import numpy as np

from dsv41.bounded import decoder_floors
from dsv41.config import ModelConfig
from serving.runtime.encoder_replay import plan_prefix_hit
from serving.runtime.runner import check_supported


def test_nano_has_every_role_of_the_full_model():
    c = ModelConfig.preset("nano")
    roles = c.roles
    swa = [r.layer_id for r in roles if r.attn_kind == "swa"]
    assert swa == [0, 1] and all(r.rope == "main" for r in roles[:2])
    assert all(r.rope == "compress" for r in roles[2:])
    ratio2 = [r for r in roles if r.compress_ratio == 2]
    ratio1 = [r for r in roles if r.compress_ratio == 1]
    assert any(r.is_kv_source for r in ratio2) and any(not r.is_kv_source for r in ratio2)  # source + consumer
    assert any(r.is_kv_source for r in ratio1) and any(not r.is_kv_source for r in ratio1)
    assert sum(r.is_kv_source for r in ratio2) >= 2  # several ratio-2 sharing groups, as layers 2/8/14
    # index sources: dense ones before the candidate source, one restricted to its candidates after it,
    # and consumers reusing an index source's top-k
    assert [r.layer_id for r in roles if r.is_candidate_source] == [c.cut_layer]
    assert any(r.uses_candidates for r in roles)
    assert any(r.is_index_source and not r.is_kv_source for r in roles)  # query-only index source (like 24)
    assert any(r.attn_kind == "compressed" and not r.is_index_source for r in roles)
    # Engram on an SWA-only layer and on a ratio-2 KV source (like layers 1 and 14), before the cut
    engram = [r for r in roles if r.engram_index is not None]
    assert [r.attn_kind for r in engram] == ["swa", "compressed"] and engram[1].is_kv_source
    assert max(r.layer_id for r in engram) < c.cut_layer
    # CED: decoder layers after a ratio-1 cut that reads the ratio-1 global KV
    assert c.compress_ratios[c.cut_layer] == 1 and c.num_hidden_layers - c.cut_layer - 1 >= 2
    assert c.hc_mult == 4 and c.n_shared_experts == 1 and c.n_routed_experts > c.num_experts_per_tok > 1
    # DSpark: block 5 with Markov and confidence heads reading the last three layers
    assert c.num_nextn_predict_layers >= 1 and c.dspark_block_size == 5 and c.dspark_markov_rank > 0
    assert c.dspark_target_layer_ids == tuple(range(c.num_hidden_layers - 3, c.num_hidden_layers))
    assert c.dspark_noise_token_id == c.vocab_size - 1
    check_supported(c)  # the serving runtime's CED topology rules hold


def test_bounded_replay_cuts_a_1k_prompt():
    c = ModelConfig.preset("nano")
    W, T = c.sliding_window, 1024
    assert W == 128 and c.max_position_embeddings >= 4096
    # decoder replay: only the last W rows of a one-chunk 1K prompt run the layers after the cut
    floors = decoder_floors(T, [(0, T)], W)
    assert floors[-1] == T - W and np.all(floors == T - W)
    # top-k and candidate selection really select at 1K (fewer rows than visible)
    assert c.index_topk < T // 2 and c.candidate_topk_blocks * c.candidate_block_size < T
    # encoder replay: a 512-token prefix hit is adopted and replays W tokens
    plan = plan_prefix_hit(512, c, bounded=True)
    assert plan.hit_tokens == 512 and plan.replayed == W
    assert plan_prefix_hit(512, c, bounded=False).hit_tokens == 0  # exact replay needs L * (W - 1) rows
