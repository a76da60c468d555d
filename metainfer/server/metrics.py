"""The Prometheus collectors /metrics serves, in a registry of the server's own (two servers in
one process, a test's say, do not share counts)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

# latency buckets from 1 ms to 2 min: a CPU decode step is tens of ms, a cold prefill seconds
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("metainfer_requests", "Requests answered, by endpoint and outcome",
                                ["endpoint", "status"], registry=r)
        self.running = Gauge("metainfer_requests_running", "Requests in the engine", registry=r)
        self.queued = Gauge("metainfer_requests_queued", "Requests waiting for a running slot", registry=r)
        self.ttft = Histogram("metainfer_time_to_first_token_seconds", "From arrival to the first token",
                              buckets=_BUCKETS, registry=r)
        self.tpot = Histogram("metainfer_time_per_output_token_seconds", "Between consecutive tokens of a request",
                              buckets=_BUCKETS, registry=r)
        self.prompt_tokens = Counter("metainfer_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("metainfer_generation_tokens", "Tokens generated", registry=r)
        self.kv_blocks = Gauge("metainfer_kv_blocks", "KV pool blocks: used by requests, cached (prefix blocks kept "
                               "for reuse, taken back when needed) and free", ["state"], registry=r)
        self.prefix_hit = Gauge("metainfer_prefix_cache_hit_ratio",
                                "Share of admitted prompt tokens the engine did not compute (cached prefix blocks)",
                                registry=r)
        self.graphs = Gauge("metainfer_graphs_compiled", "Graphs metainfer compiled for the engine", registry=r)
        self.pass_matches = Gauge("metainfer_pass_matches", "Matches of each metainfer pass over the graphs compiled "
                                  "for the engine (e.g. int4_gemm: quantized linears on metainfer's kernel)", ["pass_name"],
                                  registry=r)
        self.degree = Gauge("metainfer_parallel_degree", "Ranks serving the model, its tensor-parallel degree, and "
                            "whether experts are spread (1) or not (0)", ["kind"], registry=r)
        self.degrees = Info("metainfer_parallel", "How the model is spread over the ranks, and why", registry=r)
        self.exchange_seconds = Gauge("metainfer_rank_exchange_seconds", "Seconds rank 0's engine has spent in its "
                                      "per-step exchange with the other ranks (waiting for them included)", registry=r)
        self.spec_drafted = Gauge("metainfer_spec_drafted_tokens", "Draft tokens verified by speculative decoding",
                                  registry=r)
        self.spec_accepted = Gauge("metainfer_spec_accepted_tokens", "Draft tokens the model accepted", registry=r)
        self.spec_lengths = Gauge("metainfer_spec_draft_length_steps", "Engine steps by the draft length speculation "
                                  "chose for them (0: none paid, from measured acceptance and step times)", ["length"],
                                  registry=r)
        self.spec_acceptance = Gauge("metainfer_spec_acceptance", "Accepted / drafted tokens (0 before any draft)",
                                     registry=r)
        self.exchange_steps = Gauge("metainfer_rank_exchange_steps", "Per-step exchanges rank 0's engine has made "
                                    "(its loop's iterations)", registry=r)

    def show_parallel(self, parallel) -> None:
        self.degree.labels("ranks").set(parallel.ranks)
        self.degree.labels("tp").set(parallel.tp)
        self.degree.labels("ep").set(int(parallel.ep))
        self.degrees.info({k: str(v) for k, v in parallel.as_dict().items()})

    def render(self) -> bytes:
        return generate_latest(self.registry)
