"""The expert load balancer in the engine (serving spec §5.4, issue #6): every step's per-expert token counts
(from the runtime, fetched with the sampled tokens) go into the model's `sharding.eplb.EplbState`; every
`eplb_step_interval` steps the state rearranges the experts and the new placement is applied between steps:
the sharded model gathers its physical expert weights, the runner takes the new values (same shapes and
shardings: no recompilation). Balancedness and the rearrangement count go to /metrics.

EPLB needs expert parallelism: a `sharding.model.ShardedModel` whose experts are split over ep > 1 ranks.
Without it there is nothing to balance, and the engine refuses the option instead of reporting the
balance of a layout it does not run.
"""

from __future__ import annotations

import logging

import numpy as np

from serving.engine.metrics import EngineMetrics
from sharding.eplb import EplbConfig, EplbState

log = logging.getLogger("serving.engine")


def expert_parallel_size(model) -> int:
    """The ep of a ShardedModel's expert dispatch; 1 for a model on one device."""
    dispatch = getattr(model, "dispatch", None)
    return dispatch.ep if dispatch is not None and hasattr(model, "apply_placement") else 1


class EngineEplb:
    def __init__(self, model, config: EplbConfig, metrics: EngineMetrics):
        """Place the experts as the policy does for uniform load. Call before the Runner is built: the first
        placement adds the replica tables to the model's graph, later ones only change values."""
        ep = expert_parallel_size(model)
        if ep < 2:
            raise ValueError("eplb needs expert parallelism: a model sharded with --enable-expert-parallel over "
                             f"more than one expert-parallel rank (this model's expert-parallel size is {ep})")
        c = model.config
        self.model, self.metrics = model, metrics
        self.state = EplbState("target", c.num_hidden_layers, c.n_routed_experts, ep, config)
        model.apply_placement(self.state.placement)
        metrics.add_eplb(c.num_hidden_layers)

    def after_step(self, counts_LE: np.ndarray):
        """Record one step's [L, E] counts; on a rearrangement step the new placement (else None), for `apply`."""
        self.state.record(counts_LE)
        placement = self.state.step()
        self._export()
        return placement

    def apply(self, placement, runner) -> None:
        """Migrate the weights to `placement` between two steps (every process of a server on several processes
        does, in the same place among the steps)."""
        self.model.apply_placement(placement)
        runner.reload_params()
        self.metrics.eplb_rebalances.inc()
        log.info("EPLB rearrangement %d at step %d: balancedness %.3f -> %.3f", self.state.rearrangements,
                 self.state.steps, self.state.last_balancedness_before, self.state.last_balancedness_after)

    def _export(self) -> None:
        load = self.state.window_load()
        loads_LR = self.state.placement.rank_loads(load)
        mx = loads_LR.max(axis=1)
        self.metrics.eplb_balancedness.set(loads_LR.mean(axis=1).sum() / mx.sum() if mx.sum() > 0 else 1.0)
        for layer, b in enumerate(np.where(mx > 0, loads_LR.mean(axis=1) / np.maximum(mx, 1e-30), 1.0)):
            self.metrics.eplb_layer_balancedness(layer).set(float(b))
