"""The device mesh from vLLM-style flags (`--tensor-parallel-size`, `--data-parallel-size`,
`--enable-expert-parallel`, plus SGLang's `--expert-parallel-size`).

World = dp x tp devices. Attention runs data-parallel over dp (each dp rank holds its own requests' KV)
and tensor-parallel over tp (heads split, the single KV latent replicated). The MoE layers see the same
devices as ep x moe_tp: experts split over ep, each expert's intermediate dimension over the remaining
world / ep. vLLM's DEP is ep = dp x tp (the default with expert parallelism on); without it ep = 1 and
every device holds a 1 / world slice of every expert (TP MoE).

One mesh expresses both views. Its four axes factor dp and tp into the part that carries experts and
the rest, so the rules (`sharding.rules`) name experts by ("dp_ep", "tp_ep"), the expert intermediate by
("dp", "tp"), requests by ("dp_ep", "dp") and heads by ("tp_ep", "tp"):

    dp_ep * dp    = data-parallel size      tp_ep * tp  = tensor-parallel size
    dp_ep * tp_ep = expert-parallel size    dp * tp     = expert tensor-parallel size
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from dsv41.config import ModelConfig

MESH_AXES = ("dp_ep", "dp", "tp_ep", "tp")
DP_AXES = ("dp_ep", "dp")  # requests / KV slots
TP_AXES = ("tp_ep", "tp")  # attention heads, vocab, shared expert
EP_AXES = ("dp_ep", "tp_ep")  # routed experts; tokens are split over these for dispatch
MOE_TP_AXES = ("dp", "tp")  # routed experts' intermediate dimension


class ParallelConfigError(ValueError):
    """A parallel size is invalid for the devices or the model; the message names the field."""


@dataclass(frozen=True)
class ParallelConfig:
    """The device layout (each field is also a server flag: the name, `help` and `aliases` make it)."""

    tensor_parallel_size: int = field(default=1, metadata={
        "aliases": ("-tp",), "help": "attention heads (and, without expert parallelism, experts) split this many ways"})
    data_parallel_size: int = field(default=1, metadata={
        "aliases": ("-dp",), "help": "data-parallel attention ranks, each with its own requests, slots and KV cache"})
    enable_expert_parallel: bool = field(default=False, metadata={
        "help": "split the routed experts over the devices (all-to-all dispatch) instead of each expert's width"})
    expert_parallel_size: int | None = field(default=None, metadata={
        "aliases": ("-ep",), "help": "expert-parallel ranks (needs --enable-expert-parallel; default: dp x tp)"})
    num_cpu_devices: int | None = field(default=None, metadata={
        "help": "on the CPU backend: split the host into this many devices (parallel layouts without "
                "accelerators); with --nnodes, this process's"})
    # Several processes (hosts) on JAX's distributed runtime; SGLang's flag names (serving.engine.multiprocess).
    nnodes: int = field(default=1, metadata={
        "help": "processes (one per host) the layout spans; every process runs this command with its own "
                "--node-rank, rank 0 serves HTTP"})
    node_rank: int = field(default=0, metadata={"help": "this process's rank among --nnodes (0 serves HTTP)"})
    dist_init_addr: str | None = field(default=None, metadata={
        "help": "host:port of rank 0's coordinator (JAX's distributed runtime), the same on every process"})
    dead_rank_timeout: int = field(default=3, metadata={
        "help": "seconds without a heartbeat after which rank 0 declares a rank dead: it answers 503 and exits "
                "non-zero"})

    def __post_init__(self):
        for name in ("tensor_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ParallelConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_cpu_devices is not None and self.num_cpu_devices < 1:
            raise ParallelConfigError(f"num_cpu_devices must be >= 1, got {self.num_cpu_devices}")
        ep = self.expert_parallel_size
        if ep is not None:
            if not self.enable_expert_parallel:
                raise ParallelConfigError("expert_parallel_size needs enable_expert_parallel")
            if ep < 1 or self.world_size % ep:
                raise ParallelConfigError(f"expert_parallel_size {ep} must divide the world size "
                                          f"{self.world_size} (= data_parallel_size x tensor_parallel_size)")
        self.factors()  # the mesh must exist
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ParallelConfigError(f"node_rank {self.node_rank} must lie in [0, nnodes {self.nnodes})")
        if self.nnodes > 1:
            host, _, port = (self.dist_init_addr or "").rpartition(":")
            if not host or not port.isdigit():
                raise ParallelConfigError(f"nnodes {self.nnodes} needs dist_init_addr as host:port, got "
                                          f"{self.dist_init_addr!r}")
            if self.world_size % self.nnodes:
                raise ParallelConfigError(f"nnodes {self.nnodes} must divide the world size {self.world_size} "
                                          f"(= data_parallel_size x tensor_parallel_size): each process holds "
                                          f"world / nnodes devices")
        if self.dead_rank_timeout < 1:
            raise ParallelConfigError(f"dead_rank_timeout must be >= 1 s, got {self.dead_rank_timeout}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def ep(self) -> int:
        if not self.enable_expert_parallel:
            return 1
        return self.expert_parallel_size or self.world_size

    @property
    def moe_tp(self) -> int:
        return self.world_size // self.ep

    @property
    def layout(self) -> str:
        """"tp" (attention and MoE tensor-parallel), "dep" (data-parallel attention + expert parallel) or
        "single"."""
        if self.world_size == 1:
            return "single"
        return "dep" if self.enable_expert_parallel else "tp"

    def factors(self) -> dict[str, int]:
        """Sizes of MESH_AXES: the experts take all of dp first (dp_ep), then a factor of tp (tp_ep)."""
        dp, tp, ep = self.data_parallel_size, self.tensor_parallel_size, self.ep
        dp_ep = np.gcd(dp, ep)
        if ep % dp and dp % ep:
            raise ParallelConfigError(f"expert_parallel_size {ep} must be a multiple or a divisor of "
                                      f"data_parallel_size {dp}")
        tp_ep = ep // dp_ep
        if tp % tp_ep:
            raise ParallelConfigError(f"expert_parallel_size {ep} / data_parallel_size {dp_ep} = {tp_ep} must "
                                      f"divide tensor_parallel_size {tp}")
        return {"dp_ep": int(dp_ep), "dp": dp // int(dp_ep), "tp_ep": int(tp_ep), "tp": tp // int(tp_ep)}

    def check_model(self, c: ModelConfig) -> None:
        """Sizes the model's shapes must divide (the rules' strict axes)."""
        tp, ep, moe_tp = self.tensor_parallel_size, self.ep, self.moe_tp
        if c.num_attention_heads % tp:
            raise ParallelConfigError(f"tensor_parallel_size {tp} must divide num_attention_heads "
                                      f"{c.num_attention_heads}")
        if c.n_routed_experts % ep:
            raise ParallelConfigError(f"expert_parallel_size {ep} must divide n_routed_experts {c.n_routed_experts}")
        if c.moe_intermediate_size % moe_tp:
            raise ParallelConfigError(f"expert tensor-parallel size {moe_tp} (world {self.world_size} / ep {ep}) "
                                      f"must divide moe_intermediate_size {c.moe_intermediate_size}")

    def describe(self) -> str:
        procs = f" over {self.nnodes} processes" if self.nnodes > 1 else ""
        return (f"{self.layout}: dp={self.data_parallel_size} tp={self.tensor_parallel_size} ep={self.ep} "
                f"moe_tp={self.moe_tp} mesh={self.factors()}{procs}")

    def use_cpu_devices(self) -> None:
        """Split the host CPU into `num_cpu_devices` devices (if set); call before anything starts JAX's
        backends (creating an array does)."""
        if self.num_cpu_devices is not None:
            jax.config.update("jax_num_cpu_devices", self.num_cpu_devices)


def make_mesh(pc: ParallelConfig, devices: list | None = None) -> Mesh:
    """The (dp_ep, dp, tp_ep, tp) mesh over the first world_size devices (all processes' devices in a
    jax.distributed run), with Auto axes so `jax.jit` propagates parameter shardings."""
    devs = list(jax.devices() if devices is None else devices)
    if len(devs) < pc.world_size:
        raise ParallelConfigError(f"data_parallel_size x tensor_parallel_size = {pc.world_size} devices, "
                                  f"only {len(devs)} available")
    f = pc.factors()
    grid = np.array(devs[: pc.world_size], dtype=object).reshape([f[a] for a in MESH_AXES])
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def axis_size(mesh: Mesh, axes: tuple[str, ...]) -> int:
    return int(np.prod([mesh.shape[a] for a in axes]))
