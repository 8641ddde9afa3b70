"""Data-parallel ranks behind the scheduler interface: one `Scheduler` and one `BlockManager` per rank
(each rank has its own slots, budget, prefix cache and preemptions, as one vLLM engine core per DP rank),
and the DP router (`serving.engine.dp_router`) choosing a new request's rank: by default the rank that
served its session (`X-Session-ID`, else its prompt's first tokens), where its prefix cache is.

A request keeps its rank until it finishes (preemption re-queues it on the same rank). One engine step
schedules every rank and the runner runs all ranks' batches in one call; with one rank this is exactly
the plain scheduler.
"""

from __future__ import annotations

from collections.abc import Mapping

from dsv41.config import ModelConfig
from serving.engine.dp_router import DPRouter, RouterConfig
from serving.engine.request import Finish, Request, StopString
from serving.engine.scheduler import Scheduled, Scheduler, SchedulerConfig
from serving.runtime.block_manager import BlockManager
from serving.runtime.config import RuntimeConfig


class DataParallelScheduler:
    def __init__(self, cfg: SchedulerConfig, rc: RuntimeConfig, model_config: ModelConfig, *, num_blocks: int,
                 block_size: int, ranks: int = 1, token_buckets: tuple[int, ...] = ()):
        """`num_blocks`: each rank's KV blocks; `token_buckets`: the runner's step sizes (`Scheduler`). A rank is
        saturated for sticky routing at `cfg.dp_max_inflight` requests in flight (running or waiting), by default
        twice its `max_num_seqs` slots - full, with as many waiting."""
        self.ranks = [Scheduler(cfg, rc, model_config, BlockManager(num_blocks, block_size, cfg.enable_prefix_caching),
                                token_buckets) for _ in range(ranks)]
        self.router = DPRouter(RouterConfig(ranks, cfg.dp_routing_policy, cfg.dp_max_inflight or 2 * rc.max_num_seqs))
        self.block_size, self.blocks_per_rank = block_size, num_blocks

    # ------------------------------------------------------------------ requests
    def add(self, req: Request) -> None:
        """Route to a rank and queue there (`QueueFull` from that rank's queue)."""
        rank = self.router.route({"x-session-id": req.session_id or ""}, req.prompt_ids)
        try:
            self.ranks[rank].add(req)
        except Exception:
            self.router.finish(rank)
            raise
        req.rank = rank

    def remove(self, req: Request) -> None:
        """Take a request out (`Scheduler.remove`, an abort); a request already finished changes nothing."""
        if req.finished:
            return
        self.ranks[req.rank].remove(req)
        self.router.finish(req.rank)

    def schedule(self, max_drafts: int | Mapping[str, int] | None = None) -> list[Scheduled]:
        return [s for r in self.ranks for s in r.schedule(max_drafts)]

    def launched(self, sched: list[Scheduled]) -> list[bool]:
        return [self.ranks[s.request.rank].launched([s])[0] for s in sched]

    def postprocess(self, s: Scheduled, tokens: int | list[int] | None, pending: bool | None = None,
                    stop: StopString | None = None) -> Finish | None:
        """`Scheduler.postprocess` on the request's rank; a finished request leaves the router's count there."""
        rank = s.request.rank
        finish = self.ranks[rank].postprocess(s, tokens, pending, stop)
        if finish is not None:
            self.router.finish(rank)
        return finish

    def block_table(self, req: Request) -> list[int]:
        return self.ranks[req.rank].blocks.block_table(req.request_id)

    # ------------------------------------------------------------------ state
    @property
    def running(self) -> list[Request]:
        return [q for r in self.ranks for q in r.running]

    @property
    def num_waiting(self) -> int:
        return sum(r.num_waiting for r in self.ranks)

    @property
    def num_preemptions(self) -> int:
        return sum(r.num_preemptions for r in self.ranks)

    @property
    def num_blocks(self) -> int:
        return self.blocks_per_rank * len(self.ranks)

    @property
    def num_free_blocks(self) -> int:
        return sum(r.blocks.num_free_blocks for r in self.ranks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def rank_requests(self) -> list[int]:
        """Requests in flight per rank (waiting or running)."""
        return list(self.router.inflight)
