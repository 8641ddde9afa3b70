"""Parallel flags -> mesh factors, validation that names the bad field, and the rules table on the
model's real parameter paths (abstract meshes: no devices needed)."""

import argparse

import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

from dsv41.api import abstract_params
from dsv41.config import load_config
from serving.engine.args import add_flags, from_flags
from sharding import rules
from sharding.mesh import MESH_AXES, ParallelConfig, ParallelConfigError


def _mesh(pc: ParallelConfig) -> AbstractMesh:
    f = pc.factors()
    return AbstractMesh(tuple(f[a] for a in MESH_AXES), MESH_AXES)


@pytest.mark.parametrize("tp,dp,ep,factors", [
    (4, 1, None, dict(dp_ep=1, dp=1, tp_ep=1, tp=4)),
    (4, 2, 4, dict(dp_ep=2, dp=1, tp_ep=2, tp=2)),
    (2, 4, 2, dict(dp_ep=2, dp=2, tp_ep=1, tp=2)),
    (1, 8, 8, dict(dp_ep=8, dp=1, tp_ep=1, tp=1)),
    (2, 4, None, dict(dp_ep=4, dp=1, tp_ep=2, tp=1)),  # vLLM default: ep = dp x tp
])
def test_factors(tp, dp, ep, factors):
    pc = ParallelConfig(tp, dp, ep is not None or dp > 1, ep)
    assert pc.factors() == factors
    f = pc.factors()
    assert f["dp_ep"] * f["dp"] == dp and f["tp_ep"] * f["tp"] == tp
    assert f["dp_ep"] * f["tp_ep"] == pc.ep and f["dp"] * f["tp"] == pc.moe_tp


def test_flags_round_trip():
    ap = argparse.ArgumentParser()
    add_flags(ap, ParallelConfig, "parallelism")
    pc = from_flags(ParallelConfig, ap.parse_args(["--data-parallel-size", "8", "--enable-expert-parallel"]))
    assert (pc.world_size, pc.ep, pc.layout) == (8, 8, "dep")


@pytest.mark.parametrize("kwargs,field", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size"),
    (dict(data_parallel_size=4, tensor_parallel_size=2, enable_expert_parallel=True, expert_parallel_size=3),
     "expert_parallel_size"),
    (dict(expert_parallel_size=2), "enable_expert_parallel"),
    (dict(num_cpu_devices=0), "num_cpu_devices"),
    (dict(data_parallel_size=4, tensor_parallel_size=3, enable_expert_parallel=True, expert_parallel_size=6),
     "expert_parallel_size"),
    (dict(tensor_parallel_size=4, nnodes=2, node_rank=2, dist_init_addr="h:1"), "node_rank"),
    (dict(tensor_parallel_size=4, nnodes=2), "dist_init_addr"),
    (dict(tensor_parallel_size=4, nnodes=2, dist_init_addr="host-without-port"), "dist_init_addr"),
    (dict(tensor_parallel_size=3, nnodes=2, dist_init_addr="h:1"), "nnodes"),
    (dict(dead_rank_timeout=0), "dead_rank_timeout"),
])
def test_bad_sizes_name_the_field(kwargs, field):
    with pytest.raises(ParallelConfigError, match=field):
        ParallelConfig(**kwargs)


@pytest.mark.parametrize("pc,field", [
    (ParallelConfig(tensor_parallel_size=8), "num_attention_heads"),  # tiny: 4 heads
    (ParallelConfig(1, 16, True), "n_routed_experts"),  # tiny: 8 experts
    (ParallelConfig(tensor_parallel_size=64), "num_attention_heads"),
])
def test_model_sizes_checked(pc, field):
    with pytest.raises(ParallelConfigError, match=field):
        pc.check_model(load_config("tiny"))


def test_rules_on_model_paths():
    c = load_config("small")
    _, abstract = abstract_params(c)
    shapes = {p: s.shape for p, s in abstract.items()}
    mesh = _mesh(ParallelConfig(4, 2, True, 4))  # dp_ep=2 dp=1 tp_ep=2 tp=2
    spec = {p: rules.to_spec(mesh, rules.param_logical(p), shapes[p]) for p in shapes}
    assert spec[("layers", 3, "attn", "wq_b", "weight")] == P(("tp_ep", "tp"), None)
    assert spec[("layers", 3, "attn", "wo_b", "weight")] == P(None, ("tp_ep", "tp"))
    assert spec[("layers", 3, "ffn", "experts", "w1")] == P(("dp_ep", "tp_ep"), ("tp",), None)
    assert spec[("layers", 3, "ffn", "experts", "w2")] == P(("dp_ep", "tp_ep"), None, ("tp",))
    # the single KV latent, its compressor and the indexer are replicated; so are mHC and the router
    for p in [("layers", 2, "attn", "wkv", "weight"), ("layers", 2, "attn", "compressor", "wkv", "weight"),
              ("layers", 2, "attn", "indexer", "wk", "weight"), ("layers", 2, "hc_attn", "fn"),
              ("layers", 2, "ffn", "gate", "weight")]:
        assert spec[p] == P(), p
    # every parameter with a rule is split on at least one dimension on this mesh
    assert not rules.fallbacks(mesh, shapes)


def test_fallback_replicates_and_is_listed():
    c = load_config("tiny")  # 2 output groups x o_lora 16 = 32 rows: divisible by 4; 4 drafter experts on ep 8
    _, abstract = abstract_params(c)
    shapes = {p: s.shape for p, s in abstract.items()}
    mesh = _mesh(ParallelConfig(1, 8, True))
    assert rules.to_spec(mesh, ("experts", None, None), (4, 32, 64)) == P(None, None, None)
    assert any(f.startswith("dspark.blocks.*.ffn.experts.w1") for f in rules.fallbacks(mesh, shapes))


def test_cache_rules():
    mesh = _mesh(ParallelConfig(1, 8, True))
    shapes = [(8, 8, 32), (64, 4, 32), (64, 4, 16), (8, 2, 32), (8, 128, 2, 64)]
    specs = [rules.to_spec(mesh, rules.cache_logical(len(s)), s) for s in shapes]
    assert specs == [P(("dp_ep",), *(None,) * (len(s) - 1)) for s in shapes]  # slots / blocks split over the ranks
    tp_mesh = _mesh(ParallelConfig(4))
    assert rules.to_spec(tp_mesh, rules.cache_logical(3), (64, 4, 32)) == P(None, None, None)  # replicated


class AbstractShape:
    def __init__(self, shape):
        self.shape = shape
