"""The step's program families: what each compiled program computes, and the bucket keys that name them.

A plain step runs segment 1 on its token bucket, segment 2 on its kept-row bucket, then the sampler on its requests'
bucket. A speculative step snapshots the cache sites its verified rows will write before segment 1, and after segment
2 runs the speculative finish (verify, roll back, draft the next block) on its requests' bucket. Each family is one
jitted function over the flattened parameter leaves with the KV cache donated through it (`StepPrograms`); each of
its buckets is compiled once, before the serving loop (`serving.runtime.compiler`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from serving.runtime import segments, spec_step
from serving.runtime.config import RuntimeConfig
from serving.runtime.kv_cache import CacheLayout, KVCache
from serving.runtime.sampler import sample_rows
from serving.runtime.speculative import SpeculativeConfig
from serving.runtime.step import SegmentCarry, unpacked


class Program(enum.Enum):
    """A program family; its buckets are sizes of the dimension named here."""

    SEGMENT1 = "segment1"  # every row of the step up to the CED cut's KV path [token bucket]
    SEGMENT2 = "segment2"  # the kept rows through the other layers, and the logits [kept-row bucket]
    SAMPLE = "sample"  # plain decoding: the sampler on each rank's first n logit rows [requests per rank]
    SPEC_SNAPSHOT = "spec_snapshot"  # speculative: what the verified rows' cache sites hold before the step [requests]
    SPEC_FINISH = "spec_finish"  # speculative: verify, roll back, draft the next block [requests]

    def at(self, size: int) -> BucketKey:
        return BucketKey(self, size)


class BucketKey(NamedTuple):
    """One compiled program: a family at one size."""

    program: Program
    size: int

    def __repr__(self) -> str:  # also its name in the executable cache
        return f"{self.program.value}[{self.size}]"


class ModelGraph(NamedTuple):
    """The model module's static structure: what turns the flat parameter leaves back into the module inside a
    compiled program (the leaves themselves are arguments, so new values - an EPLB migration - need no recompile)."""

    graphdef: Any
    treedef: Any

    @classmethod
    def split(cls, module) -> tuple[ModelGraph, list[jax.Array]]:
        graphdef, state = nnx.split(module)
        leaves, treedef = jax.tree.flatten(state)
        return cls(graphdef, treedef), leaves

    def merge(self, leaves):
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, leaves))


@dataclass(frozen=True)
class StepPrograms:
    """One jitted function per program family (not compiled: `StepCompiler` compiles their buckets). Arguments:

    segment1       (graph, leaves, cache, carry, PackedBatch, prev tokens [, Engram terms]) -> (cache, carry, counts)
    segment2       (graph, leaves, cache, carry, PackedBatch [, verify logits]) -> (cache, logits, prompt logprobs,
                   counts); speculative: the logits a pair (row 0 [S, V], the donated verify logits [S, J - 1, V])
    samplers[n]    (logits, SamplingArrays) -> Sampled
    spec_snapshot  (cache, SpecInputs) -> CacheSites
    spec_finish    (graph, leaves, cache, carry, CacheSites, draft distributions, (logits row 0, verify logits),
                    SpecInputs, SamplingArrays) -> (cache, draft distributions, SpecOutput)
    `graph` (a `ModelGraph`) is static: a bucket is traced for the kernels its graph names (the MoE small-step forms
    tuned for its rows), and its executable takes the other arguments. The cache (and segment 1's carry, the
    speculative finish's draft distributions) is donated."""

    segment1: Callable
    segment2: Callable
    samplers: dict[int, Callable]
    spec_snapshot: Callable | None = None
    spec_finish: Callable | None = None

    def of(self, key: BucketKey) -> Callable:
        """The function a bucket compiles."""
        fn = {Program.SEGMENT1: self.segment1, Program.SEGMENT2: self.segment2,
              Program.SPEC_SNAPSHOT: self.spec_snapshot, Program.SPEC_FINISH: self.spec_finish,
              Program.SAMPLE: self.samplers.get(key.size)}[key.program]
        if fn is None:
            raise ValueError(f"this runner has no program for bucket {key!r}")
        return fn

    @staticmethod
    def takes_graph(key: BucketKey) -> bool:
        """Whether the bucket's function runs the model (its first, static, argument the graph)."""
        return key.program in (Program.SEGMENT1, Program.SEGMENT2, Program.SPEC_FINISH)


def build_programs(layout: CacheLayout, rc: RuntimeConfig, *, param_specs: list[jax.ShapeDtypeStruct],
                   sample_rows_per_rank: tuple[int, ...], expert_counts: bool, spec: SpeculativeConfig | None,
                   verify_rows: int, rows_fn: Callable, placement=None, cache: KVCache | None = None,
                   carry: SegmentCarry | None = None) -> StepPrograms:
    """The program families of a runner. Segment 1 runs `rows_fn` (`segment1_rows`) and writes its carry into the
    persistent buffer. On a mesh (`placement`, sharding.runtime.MeshPlacement) the segments run per data-parallel rank
    (`per_rank`), `param_specs`, `cache` and `carry` giving the shardings; on one device the batch's rank dimension
    is dropped."""
    kw = dict(fake_quant=rc.fake_quant, expert_counts=expert_counts)
    ranks = placement.ranks if placement else 1

    def per_rank(fn, outputs: tuple[str, ...]):
        return placement.per_rank(fn, param_specs, outputs) if placement else _one_rank(fn)

    def segment1(graph, leaves, cache, carry_buf, b, prev_tokens=None, engram_terms=None):
        def rank(leaves, cache, carry_buf, b, prev_tokens=None, engram_terms=None):  # one rank's cache, carry, batch
            with jax.named_scope("segment1"):  # rows_fn called as the carry's probe calls it (no None arguments)
                consts = tuple(a for a in (prev_tokens, engram_terms) if a is not None)
                cache, carry, counts = rows_fn(graph, leaves, cache, b, *consts)
                return cache, segments.write_carry(carry_buf, carry), counts

        prev = () if prev_tokens is None else (prev_tokens,) if engram_terms is None else (prev_tokens, engram_terms)
        return per_rank(rank, ("cache", "rows", "sum"))(leaves, cache, carry_buf, b, *prev)

    def segment2(graph, leaves, cache, carry_buf, b, verify_buf=None):
        def rank(leaves, cache, carry_buf, b, verify_buf=None):
            with jax.named_scope("segment2"):
                return segments.segment2(graph.merge(leaves), layout, cache, carry_buf, unpacked(b),
                                         verify_buf=verify_buf, **kw)

        extra = () if verify_buf is None else (verify_buf,)  # speculative decoding: one device (no mesh)
        return per_rank(rank, ("cache", "rows", "rows", "sum"))(leaves, cache, carry_buf, b, *extra)

    samplers = {n: _sampler(n, ranks, rc.max_top_k) for n in sample_rows_per_rank}
    if placement:
        cache_sh, carry_sh = (jax.tree.map(lambda a: a.sharding, t) for t in (cache, carry))
        rep, rows2 = placement.replicated, placement.rows_sharding(2)
        programs = StepPrograms(
            segment1=jax.jit(_named(segment1, "segment1"), static_argnums=0, donate_argnums=(2, 3),
                             out_shardings=(cache_sh, carry_sh, rep)),
            # row logprobs replicated: every process can read them (they are zeros unless asked for)
            segment2=jax.jit(_named(segment2, "segment2"), static_argnums=0, donate_argnums=2,
                             out_shardings=(cache_sh, rows2, rep, rep)),
            samplers={n: jax.jit(f, in_shardings=(rows2, rep), out_shardings=rep) for n, f in samplers.items()})
    else:
        programs = StepPrograms(
            segment1=jax.jit(_named(segment1, "segment1"), static_argnums=0, donate_argnums=(2, 3)),
            segment2=jax.jit(_named(segment2, "segment2"), static_argnums=0, donate_argnums=2),
            samplers={n: jax.jit(f) for n, f in samplers.items()})
    if spec is None:
        return programs

    def snapshot(cache, s):
        return spec_step.snapshot(layout, verify_rows, cache, s)

    def speculative(graph, leaves, cache, carry_buf, snap, q_buf, logits, s, p):
        first_SV, rest_SJV = logits
        logits_SJV = jnp.concatenate([first_SV[:, None], rest_SJV], axis=1)
        return spec_step.finish(graph.merge(leaves), layout, spec, cache, carry_buf.tails, snap, q_buf, logits_SJV, s,
                                p, max_top_k=rc.max_top_k, fake_quant=rc.fake_quant)

    return StepPrograms(programs.segment1,
                        jax.jit(_named(segment2, "segment2"), static_argnums=0, donate_argnums=(2, 5)),
                        programs.samplers,
                        spec_snapshot=jax.jit(_named(snapshot, "spec_snapshot")),
                        spec_finish=jax.jit(_named(speculative, "speculative"), static_argnums=0,
                                            donate_argnums=(2, 5)))


def _sampler(rows: int, ranks: int, max_top_k: int):
    """`sample_rows` on `rows` requests per rank, named `sample` (`jit_sample` in profiles). A speculative runner's
    plain steps sample its segments' row-0 logits: their chunks verify no drafts, so row 0 is their last row."""
    def sample(logits_RV, p):
        return sample_rows(logits_RV, p, rows=rows, ranks=ranks, max_top_k=max_top_k)

    return sample


def _named(fn, name: str):
    """The compiled module is named after the function (`jit_segment1` in HLO dumps and profiles, not `jit__lambda`)."""
    fn.__name__ = fn.__qualname__ = name
    return fn


def _one_rank(fn):
    """A rank function over batches stacked for one rank (no mesh): the batch's rank dimension dropped."""
    return lambda leaves, cache, carry, b, *prev: fn(leaves, cache, carry, jax.tree.map(lambda a: a[0], b), *prev)


def segment1_rows(layout: CacheLayout, rc: RuntimeConfig, expert_counts: bool) -> Callable:
    """One rank's segment 1 up to its carry, jitted on its own: (cache, carry of the bucket's rows, expert counts).
    The runner's probe of the carry's shapes (`StepCompiler`) and its segment-1 programs call it; on one device with
    the same argument shapes at the largest bucket, so JAX traces it there once. XLA inlines the call."""
    def rows(graph, leaves, cache, b, prev_tokens=None, engram_terms=None):
        return segments.segment1(graph.merge(leaves), layout, cache, unpacked(b), prev_tokens=prev_tokens,
                                 engram_terms=engram_terms, fake_quant=rc.fake_quant, expert_counts=expert_counts)
    return jax.jit(_named(rows, "segment1_rows"), static_argnums=0)
