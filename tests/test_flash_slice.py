"""The `v41-flash-slice` preset: v41-flash's full widths over 8 layers holding every layer role, small enough
in the release formats for one H200 (abstract shapes only: nothing is allocated)."""

from dsv41.config import ModelConfig
from serving.bench.sharding_report import memory_report
from sharding.mesh import ParallelConfig

WIDTHS = ("vocab_size", "hidden_size", "num_attention_heads", "head_dim", "qk_rope_head_dim",
          "q_lora_rank", "o_lora_rank", "o_groups", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
          "moe_intermediate_size", "index_n_heads", "index_head_dim", "index_topk", "candidate_topk_blocks",
          "candidate_block_size", "sliding_window", "hc_mult", "engram_max_ngram_size", "engram_n_heads",
          "engram_head_dim", "engram_compressed_vocab_size", "dspark_block_size", "dspark_markov_rank",
          "dspark_n_routed_experts", "dspark_num_experts_per_tok", "max_position_embeddings", "rope_scaling",
          "quantization")


def test_slice_has_the_full_widths_and_every_role():
    full, c = ModelConfig.preset("v41-flash"), ModelConfig.preset("v41-flash-slice")  # both validate
    assert {w: getattr(c, w) for w in WIDTHS} == {w: getattr(full, w) for w in WIDTHS}
    assert c.num_hidden_layers == 8 and c.num_nextn_predict_layers == 1
    roles = c.roles
    swa = [r for r in roles if r.attn_kind == "swa"]
    assert any(r.engram_index is None for r in swa) and any(r.engram_index is not None for r in swa)
    ratio2 = [r for r in roles if r.compress_ratio == 2]
    assert any(r.is_kv_source and r.is_index_source and r.engram_index is not None for r in ratio2)  # layer 14
    assert any(not r.is_kv_source for r in ratio2)  # a ratio-2 layer reading another's global KV
    cut = roles[c.cut_layer]  # layer 20: the ratio-1 KV source publishing the candidates
    assert cut.compress_ratio == 1 and cut.is_candidate_source and cut.is_index_source
    decoder = roles[c.cut_layer + 1:]
    assert any(r.uses_candidates for r in decoder)  # layers 24, 28, ...
    assert any(not r.is_index_source and r.index_source != c.cut_layer for r in decoder)  # 25..27 read 24's top-k
    assert any(not r.is_index_source and r.index_source == c.cut_layer for r in decoder)  # 21..23
    assert all(r.kv_source == c.cut_layer for r in decoder)


def test_slice_release_bytes_fit_one_h200_with_room():
    r = memory_report("v41-flash-slice", ParallelConfig(), max_model_len=131072, num_requests=64)
    device = r["param_bytes_per_device"] + r["engram_table_bytes_per_host"]  # tables on the device, until host-resident
    assert 60e9 < r["param_bytes_per_device"] < 70e9  # 8 layers of 384 MXFP4 experts (7.2 GB each) + the rest
    assert device + r["engram_staging_bytes_per_device"] + r["kv_bytes_per_device"] < 0.9 * 141e9
