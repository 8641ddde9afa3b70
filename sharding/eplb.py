"""Expert-parallel load balancer (EPLB, serving spec §5.4): per-expert load over a sliding window of steps,
a rearrangement every `eplb_step_interval` steps that replicates hot experts into redundant slots and packs
the physical experts onto ranks, and the physical -> logical map the expert dispatch applies.

One `EplbState` per model: the target and the DSpark drafter keep separate states (their routers see
different token streams). Balancedness = mean rank load / max rank load, each summed over the MoE layers.

Policy (DeepSeek's EPLB, global variant): (1) replicate - each extra slot goes to the logical expert with
the largest load per replica; (2) pack - physical experts by descending load, each to the least-loaded rank
that still has a free slot (LPT with equal slot counts). Tokens of a replicated expert are spread over its
replicas (token index mod replica count), so a replica carries load / replicas.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class EplbConfig:
    """Whether and how the engine balances the experts (vLLM's defaults; each field is also a server flag)."""

    enable_eplb: bool = field(default=False, metadata={
        "help": "record per-expert load every step and rearrange the experts over the expert-parallel ranks every "
                "--eplb-step-interval steps, hot experts replicated into redundant slots (needs "
                "--enable-expert-parallel)"})
    eplb_window_size: int = field(default=1000, metadata={"help": "steps of load the rearrangement looks at"})
    eplb_step_interval: int = field(default=3000, metadata={"help": "steps between rearrangements"})
    eplb_num_redundant_experts: int = field(default=0, metadata={
        "help": "extra expert slots over all ranks for replicas of hot experts (n_routed_experts + this must "
                "divide over the ranks)"})

    def __post_init__(self):
        for name in ("eplb_window_size", "eplb_step_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.eplb_num_redundant_experts < 0:
            raise ValueError(f"eplb_num_redundant_experts must be >= 0, got {self.eplb_num_redundant_experts}")


@dataclass(frozen=True)
class Placement:
    """phys_to_log [L, P]: the logical expert in each physical slot (rank r owns slots r*P/R ..);
    replica_table [L, E, max_replicas] (-1 padded) and replica_count [L, E]: the way back."""

    phys_to_log: np.ndarray
    n_ranks: int

    @property
    def n_logical(self) -> int:
        return int(self.phys_to_log.max()) + 1

    def replica_count(self) -> np.ndarray:
        """[L, E] int32: slots holding each logical expert."""
        L = self.phys_to_log.shape[0]
        count = np.zeros((L, self.n_logical), np.int32)
        np.add.at(count, (np.arange(L)[:, None], self.phys_to_log), 1)
        return count

    def replicas(self, width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(replica_table [L, E, width], replica_count [L, E]); `width` (default: the most replicas of any
        expert) fixes the table's shape across placements, e.g. 1 + redundant slots, so a migration keeps
        the compiled steps."""
        L, E = self.phys_to_log.shape[0], self.n_logical
        count = self.replica_count()
        need = max(int(count.max()), 1)
        if width is not None and width < need:
            raise ValueError(f"replica table width {width} < {need} replicas of one expert")
        table = np.full((L, E, width or need), -1, np.int32)
        fill = np.zeros((L, E), np.int32)
        for l in range(L):
            for p, e in enumerate(self.phys_to_log[l]):
                table[l, e, fill[l, e]] = p
                fill[l, e] += 1
        return table, count

    def rank_loads(self, load_LE: np.ndarray) -> np.ndarray:
        """[L, R] tokens per rank when each logical expert's load is split evenly over its replicas."""
        count = self.replica_count()
        L, P = self.phys_to_log.shape
        per_phys = np.take_along_axis(load_LE / np.maximum(count, 1), self.phys_to_log, axis=1)  # [L, P]
        return per_phys.reshape(L, self.n_ranks, P // self.n_ranks).sum(-1)


def identity_placement(n_layers: int, n_logical: int, n_ranks: int, n_redundant: int = 0) -> Placement:
    """The placement before any load is known: the policy applied to uniform load (without redundant
    slots, expert e in slot e)."""
    return rebalance(np.ones((n_layers, n_logical)), n_ranks, n_redundant) if n_redundant else \
        _check_slots(Placement(np.tile(np.arange(n_logical, dtype=np.int32), (n_layers, 1)), n_ranks), n_redundant)


def _check_slots(p: Placement, n_redundant: int) -> Placement:
    if p.phys_to_log.shape[1] % p.n_ranks:
        raise ValueError(f"n_routed_experts + num_redundant_experts = {p.phys_to_log.shape[1]} must divide over "
                         f"{p.n_ranks} ranks")
    return p


def balancedness(load_LE: np.ndarray, placement: Placement) -> float:
    """Mean rank load / max rank load, both summed over layers (1.0 = perfectly balanced)."""
    loads = placement.rank_loads(load_LE)
    mx = loads.max(axis=1).sum()
    return float(loads.mean(axis=1).sum() / mx) if mx > 0 else 1.0


def rebalance(load_LE: np.ndarray, n_ranks: int, n_redundant: int) -> Placement:
    """The replicate-then-pack policy for every layer."""
    L, E = load_LE.shape
    P = E + n_redundant
    if P % n_ranks:
        raise ValueError(f"n_routed_experts + num_redundant_experts = {P} must divide over {n_ranks} ranks")
    slots = P // n_ranks
    out = np.zeros((L, P), np.int32)
    for l in range(L):
        load = load_LE[l].astype(np.float64)
        count = np.ones(E, np.int64)
        for _ in range(n_redundant):
            count[np.argmax(load / count)] += 1
        phys = np.repeat(np.arange(E), count)
        weight = load[phys] / count[phys]
        rank_load, rank_fill = np.zeros(n_ranks), np.zeros(n_ranks, np.int64)
        rank_of = np.zeros(P, np.int64)
        for i in np.argsort(-weight, kind="stable"):
            open_ranks = np.flatnonzero(rank_fill < slots)
            r = open_ranks[np.argmin(rank_load[open_ranks])]
            rank_of[i] = r
            rank_load[r] += weight[i]
            rank_fill[r] += 1
        order = np.argsort(rank_of, kind="stable")  # slots grouped by rank
        out[l] = phys[order]
    return Placement(out, n_ranks)


class EplbState:
    """One model's load window and placement; `record` per step, `step` advances and rearranges."""

    def __init__(self, name: str, n_layers: int, n_logical: int, n_ranks: int, config: EplbConfig = EplbConfig()):
        self.name, self.config, self.n_ranks = name, config, n_ranks
        self.placement = identity_placement(n_layers, n_logical, n_ranks, config.eplb_num_redundant_experts)
        self.window = np.zeros((config.eplb_window_size, n_layers, n_logical), np.int64)  # ring of per-step counts
        self._load = np.zeros((n_layers, n_logical), np.int64)  # the ring's sum, kept as it turns
        self.steps = 0
        self.rearrangements = 0
        self.last_balancedness_before = self.last_balancedness_after = None

    def record(self, counts_LE: np.ndarray) -> None:
        """Token counts per (MoE layer, logical expert) of the current step."""
        if counts_LE.shape != self.window.shape[1:]:
            raise ValueError(f"{self.name}: expert counts must be {list(self.window.shape[1:])}, "
                             f"got {list(counts_LE.shape)}")
        slot = self.steps % self.config.eplb_window_size
        self._load += counts_LE - self.window[slot]
        self.window[slot] = counts_LE

    def window_load(self) -> np.ndarray:
        """[L, E] tokens per logical expert over the last eplb_window_size recorded steps."""
        return self._load.copy()

    def step(self) -> Placement | None:
        """End of a step: every eplb_step_interval steps, the new placement (apply it between steps)."""
        self.steps += 1
        if self.steps % self.config.eplb_step_interval:
            return None
        load = self.window_load()
        self.last_balancedness_before = balancedness(load, self.placement)
        self.placement = rebalance(load, self.n_ranks, self.config.eplb_num_redundant_experts)
        self.last_balancedness_after = balancedness(load, self.placement)
        self.rearrangements += 1
        return self.placement

    def balancedness(self) -> float:
        return balancedness(self.window_load(), self.placement)
