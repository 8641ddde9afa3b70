"""Prometheus metrics under vLLM's names (`vllm:*`), so existing dashboards and `vllm bench` scrapers read
them unchanged, plus the block-pool and expert-balancer (EPLB) metrics this engine adds (`dsv41:*`). One
registry per engine."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from serving.engine.draft_allocation import reached_drafts

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
            80.0, 160.0, 640.0, 2560.0)
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class EngineMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        lab = {"labelnames": ["model_name"], "registry": r}
        self._m = model_name

        def g(name, doc):
            return Gauge(name, doc, **lab).labels(model_name)

        def c(name, doc):
            return Counter(name, doc, **lab).labels(model_name)

        def h(name, doc, buckets):
            return Histogram(name, doc, buckets=buckets, **lab).labels(model_name)

        self._g, self._c = g, c  # for metrics added later (EPLB)

        self.running = g("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = g("vllm:num_requests_waiting", "Requests waiting (incl. preempted).")
        self.kv_usage = g("vllm:kv_cache_usage_perc", "Fraction of paged KV blocks referenced (1 = full).")
        self.free_blocks = g("dsv41:kv_free_blocks", "Paged KV blocks with no reference (free or evictable).")
        self.total_blocks = g("dsv41:kv_total_blocks", "Paged KV blocks in the pool.")
        self.prefix_queries = c("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = c("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        self.prompt_tokens = c("vllm:prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = c("vllm:generation_tokens", "Generated tokens.")
        self.preemptions = c("vllm:num_preemptions", "Preemptions (recompute).")
        self.ttft = h("vllm:time_to_first_token_seconds", "Arrival to first token.", _LATENCY)
        self.itl = h("vllm:inter_token_latency_seconds", "Gap between consecutive tokens of a request.", _ITL)
        self.e2e = h("vllm:e2e_request_latency_seconds", "Arrival to finish.", _LATENCY)
        self._success = Counter("vllm:request_success", "Finished requests by reason.",
                                labelnames=["model_name", "finished_reason"], registry=r)
        self._rank_requests = Gauge("dsv41:dp_rank_requests", "Requests in flight (waiting or running) on a "
                                    "data-parallel rank.", labelnames=["model_name", "rank"], registry=r)

    def rank_requests(self, rank: int):
        return self._rank_requests.labels(self._m, str(rank))

    def add_eplb(self, n_layers: int) -> None:
        """The expert load balancer's metrics (only engines with EPLB on export them)."""
        self.eplb_balancedness = self._g("dsv41:eplb_balancedness", "EPLB: mean / max expert-parallel rank load "
                                         "over the load window, each summed over MoE layers (1 = balanced).")
        self.eplb_rebalances = self._c("dsv41:eplb_rebalances", "EPLB expert rearrangements (weight migrations).")
        self._eplb_layer = Gauge("dsv41:eplb_layer_balancedness", "EPLB: one MoE layer's mean / max rank load.",
                                 labelnames=["model_name", "layer"], registry=self.registry)
        self.eplb_balancedness.set(1.0)  # no load yet
        for layer in range(n_layers):
            self.eplb_layer_balancedness(layer).set(1.0)

    def eplb_layer_balancedness(self, layer: int):
        return self._eplb_layer.labels(self._m, str(layer))

    def add_spec_decode(self, k: int) -> None:
        """Speculative decoding's metrics, vLLM's names (mean acceptance length = 1 + accepted / drafts)."""
        self.spec_drafts = self._c("vllm:spec_decode_num_drafts", "Verification steps with at least one draft.")
        self.spec_draft_tokens = self._c("vllm:spec_decode_num_draft_tokens", "Drafted tokens verified.")
        self.spec_accepted = self._c("vllm:spec_decode_num_accepted_tokens", "Drafted tokens accepted.")
        per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted drafts by position in the "
                          "draft (0: the first).", labelnames=["model_name", "position"], registry=self.registry)
        self.spec_accepted_per_pos = [per_pos.labels(self._m, str(i)) for i in range(k)]
        self.spec_chosen_k = self._g("dsv41:spec_decode_k", "Drafts per request the next step verifies at most, as the "
                                     "speculation policy chose (0: a plain step).")
        steps = Counter("dsv41:spec_decode_steps", "Steps run by the drafts per request they verified at most (k; 0: "
                        "plain steps).", labelnames=["model_name", "k"], registry=self.registry)
        self.spec_steps = [steps.labels(self._m, str(i)) for i in range(k + 1)]
        drafts = Counter("dsv41:spec_decode_request_drafts", "Decoding requests in steps verifying drafts, by the "
                         "drafts each verified (its own k: the policy's k split by each request's acceptance).",
                         labelnames=["model_name", "k"], registry=self.registry)
        self.spec_request_drafts = [drafts.labels(self._m, str(i)) for i in range(k + 1)]
        # the drafter's confidence head against what verification decided: calibrated if, in every bin, accepted /
        # drafts is about the bin's confidence (the adaptive allocator takes a greedy request's gains from it)
        doc = ("greedy requests' drafts verified with every draft before them accepted, by the drafter's confidence "
               "in the draft (bin: its tenth, 0.0 for [0, 0.1) .. 0.9 for [0.9, 1])")
        reached = Counter("dsv41:spec_decode_confidence_drafts", doc[0].upper() + doc[1:] + ".",
                          labelnames=["model_name", "bin"], registry=self.registry)
        accepted = Counter("dsv41:spec_decode_confidence_accepted", "Of the " + doc + ": those accepted.",
                           labelnames=["model_name", "bin"], registry=self.registry)
        self._confidence_bins = [(reached.labels(self._m, f"{b / 10:.1f}"), accepted.labels(self._m, f"{b / 10:.1f}"))
                                 for b in range(10)]

    def spec_confidence(self, confidence: list[float], num_draft: int, num_accepted: int) -> None:
        """A greedy verification of `num_draft` drafts, the first `num_accepted` accepted, which the drafter rated
        `confidence` (per draft): each draft verification reached, by its confidence's bin."""
        for i, was_accepted in reached_drafts(num_draft, num_accepted, len(confidence)):
            reached, accepted = self._confidence_bins[min(max(int(confidence[i] * 10), 0), 9)]
            reached.inc()
            if was_accepted:
                accepted.inc()

    def add_multiprocess(self) -> None:
        """Rank 0 of a server on several processes: the steps it publishes to the other ranks."""
        self.step_broadcasts = self._c("dsv41:step_broadcasts", "Steps published to the other processes.")
        self.step_broadcast_bytes = self._c("dsv41:step_broadcast_bytes", "Bytes of the steps published (pickled "
                                            "host inputs).")
        self.step_broadcast_seconds = self._c("dsv41:step_broadcast_seconds", "Rank 0's time publishing steps "
                                              "(pickling and the key-value store's round trip).")

    def step_broadcast(self, nbytes: int, seconds: float) -> None:
        self.step_broadcasts.inc()
        self.step_broadcast_bytes.inc(nbytes)
        self.step_broadcast_seconds.inc(seconds)

    def finished(self, reason: str) -> None:
        self._success.labels(self._m, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
