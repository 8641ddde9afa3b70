"""The one table of partition rules: parameter paths, KV-cache groups and activations -> logical axes ->
mesh axes (`sharding.mesh`). Nothing else in the repository decides a sharding.

Logical axes (a dimension named here is split over the mesh axes of LOGICAL_TO_MESH):
  heads         attention heads (wq_b rows, attn_sink)                                       -> tp
  o_groups      rows of the grouped O-projection (wo_a out, wo_b in; a group split when tp > G) -> tp
  vocab         embedding and LM-head rows                                                   -> tp
  shared_inter  the shared expert's intermediate dimension                                   -> tp
  experts       routed experts                                                               -> ep
  expert_inter  a routed expert's intermediate dimension                                     -> moe_tp
  requests      KV-cache slots and blocks (each dp rank holds its own requests' KV)          -> dp
  dispatch      tokens entering the MoE all-to-all                                           -> ep
Everything unnamed is replicated: the KV latent projections (wkv, compressor) and the indexer, because
V4.1 has one shared K=V latent (one "KV head"), mHC, norms, the router, Engram.

A logical axis whose mesh size does not divide the dimension falls back to replicated for that tensor
(e.g. tiny's 2 output groups on tp=4); `ParallelConfig.check_model` rejects the sizes that must divide
(heads, experts, expert intermediate), and `fallbacks()` lists what was replicated instead.
"""

from __future__ import annotations

import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sharding.mesh import DP_AXES, EP_AXES, MOE_TP_AXES, TP_AXES

Logical = tuple[str | None, ...]

LOGICAL_TO_MESH: dict[str, tuple[str, ...]] = {
    "heads": TP_AXES,
    "o_groups": TP_AXES,
    "vocab": TP_AXES,
    "shared_inter": TP_AXES,
    "experts": EP_AXES,
    "expert_inter": MOE_TP_AXES,
    "requests": DP_AXES,
    "dispatch": EP_AXES,
}

# Parameter path (dot-joined, block index as *) -> logical axes of each dimension; first match wins.
_BLOCK = r"(?:layers|dspark\.blocks)\.\*\."
PARAM_RULES: tuple[tuple[str, Logical], ...] = (
    # An FP8 linear's `scale` [ceil(O/32), ceil(I/32)] and MXFP4 experts' packed bytes [E, O, I/2] and `_scale`
    # [E, O, I/32] split like the float weight they encode.
    (_BLOCK + r"attn\.wq_b\.(weight|scale)", ("heads", None)),  # [H*d, q]: contiguous heads per rank
    (_BLOCK + r"attn\.attn_sink", ("heads",)),  # [H]
    (_BLOCK + r"attn\.wo_a\.(weight|scale)", ("o_groups", None)),  # [G*o, H*d/G]: the rank's heads' groups
    (_BLOCK + r"attn\.wo_b\.(weight|scale)", (None, "o_groups")),  # [D, G*o]: partial sums -> all-reduce
    (_BLOCK + r"ffn\.experts\.w[13](_scale)?", ("experts", "expert_inter", None)),  # [E, I, D]
    (_BLOCK + r"ffn\.experts\.w2(_scale)?", ("experts", None, "expert_inter")),  # [E, D, I]
    (_BLOCK + r"ffn\.shared_experts\.w[13]\.(weight|scale)", ("shared_inter", None)),  # [I, D]
    (_BLOCK + r"ffn\.shared_experts\.w2\.(weight|scale)", (None, "shared_inter")),  # [D, I]
    (r"embed\.weight", ("vocab", None)),  # [V, D]
    (r"head\.weight", ("vocab", None)),  # [V, D]
)

# Every KV-cache array (serving.runtime.kv_cache) leads with request slots or blocks: [num_slots or num_blocks, ...],
# split over the data-parallel ranks (each rank's slots and blocks are its own); the rest is replicated.
CACHE_LEAD: Logical = ("requests",)

ACTIVATION_RULES: dict[str, Logical] = {
    "dispatch_tokens": ("dispatch", None),  # [T, D] entering the MoE all-to-all
    "dispatch_routes": ("dispatch", None),  # [T, k] expert ids / weights
}


def path_key(path: tuple) -> str:
    """('layers', 3, 'attn', 'wq_b', 'weight') -> 'layers.*.attn.wq_b.weight'."""
    return ".".join("*" if isinstance(p, int) or str(p).isdigit() else str(p) for p in path)


def param_logical(path: tuple) -> Logical | None:
    key = path_key(path)
    for pattern, axes in PARAM_RULES:
        if re.fullmatch(pattern, key):
            return axes
    return None


def to_spec(mesh: Mesh, logical: Logical | None, shape: tuple[int, ...]) -> P:
    """Logical axes -> PartitionSpec, replicating a dimension the mesh axes' size does not divide and
    dropping mesh axes of size 1."""
    if logical is None:
        return P()
    if len(logical) != len(shape):
        raise ValueError(f"rule {logical} has {len(logical)} axes for a tensor of shape {list(shape)}")
    out = []
    for name, dim in zip(logical, shape):
        axes = tuple(a for a in LOGICAL_TO_MESH[name] if mesh.shape[a] > 1) if name else ()
        size = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
        out.append(axes if axes and dim % size == 0 else None)
    return P(*out)


def param_shardings(mesh: Mesh, shapes: dict[tuple, tuple[int, ...]]) -> dict[tuple, NamedSharding]:
    """{parameter path: NamedSharding} from the table. MXFP4 experts' exponent bytes must split exactly like their
    values (the expert dispatch hands each rank its slices of both): a layout that would replicate one and not
    the other is refused, naming the tensor."""
    specs = {p: to_spec(mesh, param_logical(p), tuple(s)) for p, s in shapes.items()}
    for p, spec in specs.items():
        leaf = str(p[-1])
        if leaf.endswith("_scale") and p[:-1] + (leaf[:-6],) in specs and specs[p[:-1] + (leaf[:-6],)] != spec:
            raise ValueError(f"{path_key(p)} {list(shapes[p])} cannot be split like its values "
                             f"({specs[p[:-1] + (leaf[:-6],)]}) on this mesh: the expert intermediate / 32 must "
                             "divide by the expert tensor-parallel size")
    return {p: NamedSharding(mesh, spec) for p, spec in specs.items()}


def param_sharding_fn(mesh: Mesh):
    """`(parameter path, shape) -> NamedSharding` by the table: what `dsv41.load(..., shardings=)` takes to place
    each tensor's shards straight from the checkpoint."""
    return lambda path, shape: NamedSharding(mesh, to_spec(mesh, param_logical(path), tuple(shape)))


def fallbacks(mesh: Mesh, shapes: dict[tuple, tuple[int, ...]]) -> list[str]:
    """Rule-named tensors replicated on some dimension because the mesh size did not divide it."""
    out = set()
    for p, s in shapes.items():
        logical = param_logical(p)
        if logical is None:
            continue
        spec = to_spec(mesh, logical, tuple(s))
        for name, got, dim in zip(logical, spec, s):
            if name and got is None and any(mesh.shape[a] > 1 for a in LOGICAL_TO_MESH[name]):
                out.add(f"{path_key(p)} dim {dim} ({name})")
    return sorted(out)


def cache_shardings(mesh: Mesh, cache_shapes):
    """The KV-cache pytree (of arrays or ShapeDtypeStructs) -> the same pytree of NamedShardings."""
    return jax.tree.map(lambda a: NamedSharding(mesh, to_spec(mesh, cache_logical(len(a.shape)), tuple(a.shape))),
                        cache_shapes)


def cache_logical(ndim: int) -> Logical:
    """The logical axes of an `ndim`-dimensional cache array."""
    return CACHE_LEAD + (None,) * (ndim - 1)


def activation_spec(mesh: Mesh, name: str, shape: tuple[int, ...]) -> P:
    return to_spec(mesh, ACTIVATION_RULES[name], shape)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def place(tree, shardings):
    """device_put a pytree onto its shardings (works across processes: every process passes the full
    host value and keeps its addressable shards; an array already global, e.g. a checkpoint tensor placed as it
    was read, moves between shardings on the devices)."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)  # one batched transfer

    def put(a, s):
        if isinstance(a, jax.Array) and not a.is_fully_addressable:
            return a if a.sharding == s else jax.device_put(a, s)
        return jax.make_array_from_callback(np.shape(a), s, lambda idx: np.asarray(a)[idx])

    return jax.tree.map(put, tree, shardings)
