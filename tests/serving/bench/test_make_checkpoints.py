"""make_checkpoints: a V4 and a V4.1 release checkpoint of matching dimensions that dsv41.load reads back."""

import json

import numpy as np
import pytest

import dsv41
from serving.bench import make_checkpoints


def test_tiny_pair_loads_with_matching_dimensions(tmp_path):
    assert make_checkpoints.main([str(tmp_path), "--size", "tiny", "--seed", "3"]) == 0
    meta = json.loads((tmp_path / "make_checkpoints.json").read_text())
    v4, v41 = dsv41.load(tmp_path / "v4"), dsv41.load(tmp_path / "v41")
    assert (v4.config.family, v41.config.family) == ("v4", "v41")
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                  "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "index_topk"):
        assert getattr(v4.config, field) == getattr(v41.config, field), field
    assert v4.config.compress_ratios == (0, 4, 128, 4) and v41.config.compress_ratios == (0, 2, 1, 1)
    for name, model in (("v4", v4), ("v41", v41)):
        assert meta["parameters"][name] == sum(int(np.prod(p.shape)) for p in model.params.values())
        assert np.isfinite(model.logits(np.arange(10, 30))).all()
    # the seed decides the weights
    again = make_checkpoints.release_configs("tiny")[1]
    n = make_checkpoints.write_checkpoint(tmp_path / "again", again, seed=3, dtype="float32")
    assert n == meta["parameters"]["v41"]
    same = dsv41.load(tmp_path / "again")
    assert all(np.array_equal(same.params[p], v41.params[p]) for p in v41.params)


def test_peer_size_matches_the_peer_v4():
    v4, v41 = make_checkpoints.release_configs("peer")
    c4 = dsv41.ModelConfig.from_release_dict(v4)
    _, abstract = dsv41.abstract_params(c4)
    n = sum(int(np.prod(s.shape)) for s in abstract.values())
    assert 78.0e6 < n < 79.0e6  # the peer's tiny-v4 is 78.5M parameters
    assert dsv41.ModelConfig.from_release_dict(v41).family == "v41"
    with pytest.raises(ValueError, match="unknown --size"):
        make_checkpoints.release_configs("huge")


def test_byte_level_tokenizer_is_written_when_available(tmp_path):
    tok = pytest.importorskip("serving.text.tokenizer", reason="serving.text.tokenizer is not in this checkout")
    assert make_checkpoints.write_tokenizer(tmp_path, 512)
    loaded = tok.Tokenizer.from_dir(tmp_path)
    # the chat workload's letters are one token each
    assert len(loaded.encode("abcxyz")) == 6 and loaded.decode(loaded.encode("hello")) == "hello"
