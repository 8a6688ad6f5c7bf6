"""Prometheus metrics of one server (its own registry, so several servers can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

TOKEN_SECONDS_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
REQUEST_SECONDS_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class Metrics:
    def __init__(self) -> None:
        disable_created_metrics()  # no *_created series: counters and histograms only
        r = self.registry = CollectorRegistry()
        self.requests = Counter("iquest_requests", "HTTP requests answered, by route and status code "
                                "(499 = the client went away mid-request)", ["route", "status"], registry=r)
        self.finished = Counter("iquest_decodes", "Decodes ended, by reason (stop, length, cancelled, "
                                "deadline, shutdown, error)", ["reason"], registry=r)
        self.tokens = Counter("iquest_emitted_tokens", "Tokens emitted by the engine", registry=r)
        self.prompt_tokens = Counter("iquest_prompt_tokens", "Prompt tokens of the decodes started", registry=r)
        self.prefill_tokens = Counter("iquest_prefill_tokens", "Prompt tokens prefilled: the prompt tokens less "
                                      "those whose KV was reused", registry=r)
        self.cached_tokens = Counter("iquest_prefix_cached_tokens", "Prompt tokens whose KV came from the last "
                                     "request's prefill (--prefix-reuse)", registry=r)
        self.prefix_lookups = Counter("iquest_prefix_lookups", "Decodes started with --prefix-reuse on, by result: "
                                      "hit (a prefix reused) or miss (a full prefill)", ["result"], registry=r)
        self.snapshot_bytes = Gauge("iquest_prefix_snapshot_bytes", "Device bytes each rank holds for prefix reuse "
                                    "(a copy of its ring caches; 0 when off)", registry=r)
        self.rounds = Counter("iquest_rounds", "Speculative rounds run (steps that verified drafts)", registry=r)
        self.drafts = Counter("iquest_drafts", "Drafts verified in speculative rounds", registry=r)
        self.accepted = Counter("iquest_accepted_drafts", "Drafts accepted in speculative rounds", registry=r)
        self.mean_accepted = Gauge("iquest_mean_accepted_length",
                                   "Accepted drafts per speculative round since start", registry=r)
        self.mean_accepted.set_function(
            lambda: self.accepted._value.get() / max(self.rounds._value.get(), 1.0))
        self.queue_depth = Gauge("iquest_queue_depth", "Requests admitted and waiting for the engine", registry=r)
        self.running = Gauge("iquest_running", "Requests decoding now (0 or 1)", registry=r)
        self.tpot = Histogram("iquest_time_per_output_token_seconds",
                              "Per request: (end - first token) / (tokens - 1)", buckets=TOKEN_SECONDS_BUCKETS,
                              registry=r)
        self.ttft = Histogram("iquest_time_to_first_token_seconds", "Per request: arrival to first token "
                              "(queueing and prefill included)", registry=r)
        self.e2e = Histogram("iquest_e2e_request_latency_seconds", "Per decode: arrival to its end, "
                             "whatever the reason", buckets=REQUEST_SECONDS_BUCKETS, registry=r)

    def observe_step(self, step) -> None:
        self.tokens.inc(len(step.tokens))
        if step.drafts > 0:
            self.rounds.inc()
            self.drafts.inc(step.drafts)
            self.accepted.inc(step.accepted)

    def render(self) -> bytes:
        return generate_latest(self.registry)
