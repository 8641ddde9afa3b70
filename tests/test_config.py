"""ModelConfig: presets, the derived role table (spec §1.2), round trips and clear errors."""

import json

import pytest

from dsv41.config import ConfigError, ModelConfig, load_config, yarn_bounds


def test_v41_flash_role_table_matches_spec():
    c = ModelConfig.preset("v41-flash")
    assert c.family == "v41" and c.num_hidden_layers == 40 and c.num_nextn_predict_layers == 3
    roles = c.roles
    assert [r.attn_kind for r in roles[:2]] == ["swa", "swa"] and all(r.rope == "main" for r in roles[:2])
    for r in roles[2:]:
        assert r.rope == "compress"
        assert r.kv_source == max(s for s in (2, 8, 14, 20) if s <= r.layer_id)
        assert r.index_source == max(s for s in (2, 8, 14, 20, 24, 28, 32, 36) if s <= r.layer_id)
        assert r.compress_ratio == (2 if r.layer_id < 20 else 1)
    assert [r.layer_id for r in roles if r.is_kv_source] == [2, 8, 14, 20]
    assert [r.layer_id for r in roles if r.is_candidate_source] == [20]
    assert [r.layer_id for r in roles if r.uses_candidates] == [24, 28, 32, 36]
    assert [r.layer_id for r in roles if r.engram_index is not None] == [1, 14]
    assert c.cut_layer == 20
    assert yarn_bounds(c) == (15, 25)  # spec §2.4


def test_v4_flash_roles():
    c = ModelConfig.preset("v4-flash")
    kinds = [r.attn_kind for r in c.roles]
    assert kinds[:4] == ["swa", "swa", "csa", "hca"] and kinds[-1] == "csa" and len(kinds) == 43
    assert [r.layer_id for r in c.roles if r.hash_routed] == [0, 1, 2]
    assert not c.delayed_pre and c.q_head_norm and c.hc_head


@pytest.mark.parametrize("name", ["v41-flash", "v41-flash-slice", "v4-flash", "tiny", "small", "nano"])
def test_release_dict_round_trip(name):
    c = ModelConfig.preset(name)
    again = ModelConfig.from_release_dict(json.loads(json.dumps(c.to_release_dict())))
    assert again == c and again.roles == c.roles and again.quantization == c.quantization


def _tiny_raw():
    return ModelConfig.preset("tiny").to_release_dict()


def _with(**changes):
    raw = _tiny_raw()
    raw["text_config"].update(changes)
    return raw


@pytest.mark.parametrize("changes, message", [
    (dict(compress_ratios=[0, 0, 3, 2, 1, 1, 1, 1, 0]), "compress_ratios[2] = 3 is unknown"),
    (dict(kv_source_layer_ids=[4]), "layer 2 is compressed (ratio 2) but no KV source"),
    (dict(kv_source_layer_ids=[2]), "layer 4 (ratio 1) would read the global KV of layer 2 (ratio 2)"),
    (dict(index_source_layer_ids=[4, 6]), "layer 2 is compressed but no index source"),
    (dict(kv_source_layer_ids=[0, 2, 4]), "kv_source_layer_ids entry 0 is not a compressed backbone layer"),
    (dict(engram_num_embeddings=[434, 607]), "engram_num_embeddings[1] = 607"),
    (dict(hidden_size="64"), "field hidden_size must be an integer"),
    (dict(candidate_topk_blocks=1), "cannot fill index_topk"),
    (dict(compress_ratios=[0, 0, 2]), "compress_ratios has 3 entries"),
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(num_key_value_heads=2), "num_key_value_heads must be 1"),
])
def test_bad_configs_name_the_field(changes, message):
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_release_dict(_with(**changes), "cfg.json")
    assert message in str(e.value) and str(e.value).startswith("cfg.json: "), str(e.value)


def test_missing_field_and_unknown_model_type(tmp_path):
    raw = _tiny_raw()
    del raw["text_config"]["head_dim"]
    with pytest.raises(ConfigError, match="required field head_dim is missing"):
        ModelConfig.from_release_dict(raw)
    with pytest.raises(ConfigError, match="model_type 'llama'"):
        ModelConfig.from_release_dict({"model_type": "llama"})
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match="neither a preset"):
        load_config(tmp_path / "nope")


def test_optional_v41_fields_absent():
    """vLLM-style reading: no candidate_* keys = no candidate source; engram_layer_ids [] = no Engram;
    compress_ratios with one entry per backbone layer."""
    raw = _tiny_raw()
    t = raw["text_config"]
    for k in [k for k in t if k.startswith(("candidate_", "engram_", "dspark_"))]:
        del t[k]
    t["engram_layer_ids"], t["num_nextn_predict_layers"], t["compress_ratios"] = [], 0, t["compress_ratios"][:8]
    c = ModelConfig.from_release_dict(raw)
    assert c.candidate_source_layer_id is None and not any(r.uses_candidates for r in c.roles)
    assert not c.engram_layer_ids and c.num_nextn_predict_layers == 0
