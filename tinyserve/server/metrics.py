"""Prometheus text metrics for `GET /metrics`: requests, tokens and latencies counted here,
queue, memory and cache figures read from `engine.stats()` at scrape time.
"""

from __future__ import annotations

import bisect
import threading
from typing import Any

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                    0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_PREFIX = "tinyserve:"

# EngineStats attribute -> (gauge name, help)
_GAUGES = (
    ("running", "num_requests_running", "requests being generated"),
    ("waiting", "num_requests_waiting", "requests queued for admission"),
    ("kv_pages_used", "kv_pages_used", "KV cache pages in use"),
    ("kv_pages_total", "kv_pages_total", "KV cache pages in all"),
    ("state_slots_used", "gdn_state_slots_used",
     "GDN state slots held by running requests (one each)"),
    ("state_slots_total", "gdn_state_slots_total",
     "GDN state slots in all (the most sequences at once)"),
    ("expert_cache_hit_rate", "expert_cache_hit_rate",
     "fraction of routed-expert lookups served from the GPU expert cache"),
    ("prefix_cache_pages", "prefix_cache_pages", "KV cache pages held by the prefix cache"),
)
# EngineStats attribute -> (counter name, help)
_COUNTERS = (
    ("preemptions", "preemptions_total",
     "running requests preempted (pages and state slot returned, recomputed later)"),
    ("prefix_cache_queries", "prefix_cache_queries_total",
     "admitted requests that looked up the prefix cache"),
    ("prefix_cache_hits", "prefix_cache_hits_total",
     "admitted requests that reused a cached prefix"),
    ("prefix_cached_tokens", "prompt_tokens_cached_total",
     "prompt tokens served from the prefix cache"),
    ("expert_cache_hits", "expert_cache_hits_total",
     "routed-expert lookups served from the GPU expert cache"),
    ("expert_cache_misses", "expert_cache_misses_total",
     "routed-expert lookups copied in from the host expert store"),
    ("expert_cache_h2d_bytes", "expert_cache_h2d_bytes_total",
     "bytes of expert weights copied host to device"),
    ("expert_cpu_computed", "expert_cpu_computed_total",
     "routed experts missing from the GPU cache computed on the CPU instead of copied"),
)


def _fmt(value: float) -> str:
    if value == float("inf"):
        return "+Inf"
    return repr(float(value)) if isinstance(value, float) else str(value)


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def lines(self, name: str) -> list[str]:
        out, acc = [], 0
        for bound, count in zip(self.buckets + (float("inf"),), self.counts, strict=True):
            acc += count
            out.append(f'{name}_bucket{{le="{_fmt(bound)}"}} {acc}')
        out += [f"{name}_sum {self.total!r}", f"{name}_count {self.n}"]
        return out


class ServerMetrics:
    """Thread-safe counters and histograms of the API server."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = {}  # (endpoint, outcome) -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = _Histogram(_LATENCY_BUCKETS)
        self.itl = _Histogram(_LATENCY_BUCKETS)
        self.e2e = _Histogram(_LATENCY_BUCKETS)

    def request_done(self, endpoint: str, outcome: str, prompt_tokens: int = 0,
                     completion_tokens: int = 0, latency_s: float | None = None) -> None:
        """Count one finished request. `outcome` is a finish reason or an error class."""
        with self._lock:
            key = (endpoint, outcome)
            self.requests[key] = self.requests.get(key, 0) + 1
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += completion_tokens
            if latency_s is not None:
                self.e2e.observe(latency_s)

    def observe_latency(self, seconds: float, *, first_token: bool) -> None:
        """The time to the first token, or one token's share of the time between two."""
        with self._lock:
            (self.ttft if first_token else self.itl).observe(seconds)

    def render(self, stats: Any | None = None) -> str:
        """The Prometheus text exposition (version 0.0.4)."""
        lines: list[str] = []

        def add(name: str, kind: str, help_: str, *values: str) -> None:
            lines.extend([f"# HELP {_PREFIX}{name} {help_}", f"# TYPE {_PREFIX}{name} {kind}",
                          *values])

        with self._lock:
            add("requests_total", "counter", "finished requests by endpoint and outcome",
                *(f'{_PREFIX}requests_total{{endpoint="{e}",outcome="{o}"}} {n}'
                  for (e, o), n in sorted(self.requests.items())))
            for name, value, help_ in (
                    ("prompt_tokens_total", self.prompt_tokens, "prompt tokens processed"),
                    ("generation_tokens_total", self.generation_tokens, "tokens generated")):
                add(name, "counter", help_, f"{_PREFIX}{name} {value}")
            for name, hist, help_ in (
                    ("time_to_first_token_seconds", self.ttft, "time to the first token"),
                    ("inter_token_latency_seconds", self.itl, "time between streamed tokens"),
                    ("e2e_request_latency_seconds", self.e2e, "request latency")):
                add(name, "histogram", help_, *hist.lines(_PREFIX + name))
        for table, kind in ((_GAUGES, "gauge"), (_COUNTERS, "counter")):
            for attr, name, help_ in table:
                value = getattr(stats, attr, None)  # absent when the engine has no such part
                if isinstance(value, (int, float)):
                    add(name, kind, help_, f"{_PREFIX}{name} {_fmt(value)}")
        return "\n".join(lines) + "\n"
