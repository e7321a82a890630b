"""Server metrics in the Prometheus text exposition format (version 0.0.4).

Written by hand rather than with `prometheus_client`: the format is a few plain lines per metric and
the serving extra then needs nothing beyond the web server. Updated by the engine thread, read by
the `/metrics` route; one lock guards both.
"""

from __future__ import annotations

import collections
import threading
import time

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RATE_WINDOW_S = 10.0  # tokens/s is the rate over this trailing window


class Metrics:
    def __init__(self, max_batch: int) -> None:
        self.max_batch = max_batch
        self._lock = threading.Lock()
        self.requests = 0
        self.finished: collections.Counter[str] = collections.Counter()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.queue_depth = 0
        self.running = 0
        self.ttft_buckets = [0] * len(TTFT_BUCKETS)
        self.ttft_sum, self.ttft_count = 0.0, 0
        self.prefix_queries = self.prefix_hits = self.prefix_query_tokens = self.prefix_hit_tokens = 0
        self._recent: collections.deque[tuple[float, int]] = collections.deque()  # (time, tokens)

    # ---- updates (engine thread) -------------------------------------------------------
    def request_started(self, prompt_tokens: int) -> None:
        with self._lock:
            self.requests += 1
            self.prompt_tokens += prompt_tokens

    def request_finished(self, reason: str) -> None:
        with self._lock:
            self.finished[reason] += 1

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft_sum += seconds
            self.ttft_count += 1
            for i, bound in enumerate(TTFT_BUCKETS):
                if seconds <= bound:
                    self.ttft_buckets[i] += 1

    def tokens_generated(self, count: int) -> None:
        now = time.monotonic()
        with self._lock:
            self.generation_tokens += count
            self._recent.append((now, count))
            while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
                self._recent.popleft()

    def prefix_lookup(self, prompt_tokens: int, hit_tokens: int) -> None:
        with self._lock:
            self.prefix_queries += 1
            self.prefix_hits += hit_tokens > 0
            self.prefix_query_tokens += prompt_tokens
            self.prefix_hit_tokens += hit_tokens

    def observe_state(self, queue_depth: int, running: int) -> None:
        with self._lock:
            self.queue_depth, self.running = queue_depth, running

    # ---- reading ------------------------------------------------------------------------
    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            recent = [(t, n) for t, n in self._recent if t >= now - RATE_WINDOW_S]
        if not recent:
            return 0.0
        return sum(n for _, n in recent) / max(now - recent[0][0], 1e-3)

    def render(self) -> str:
        """The exposition text."""
        rate = self.tokens_per_second()
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP k3jax_{name} {help_text}")
            lines.append(f"# TYPE k3jax_{name} {kind}")
            lines.extend(f"k3jax_{name}{labels} {value:g}" if isinstance(value, float) else
                         f"k3jax_{name}{labels} {value}" for labels, value in samples)

        with self._lock:
            metric("requests_total", "counter", "Requests accepted.", [("", self.requests)])
            metric("requests_finished_total", "counter", "Requests finished, by finish reason.",
                   [(f'{{finish_reason="{r}"}}', n) for r, n in sorted(self.finished.items())])
            metric("prompt_tokens_total", "counter", "Prompt tokens of accepted requests.", [("", self.prompt_tokens)])
            metric("generation_tokens_total", "counter", "Tokens generated.", [("", self.generation_tokens)])
            metric("generation_tokens_per_second", "gauge",
                   f"Tokens generated per second over the last {RATE_WINDOW_S:g} s.", [("", float(rate))])
            metric("queue_depth", "gauge", "Requests waiting for a slot.", [("", self.queue_depth)])
            metric("running_requests", "gauge", "Requests in the decode batch.", [("", self.running)])
            metric("batch_occupancy", "gauge", "Fraction of the decode batch's slots in use.",
                   [("", float(self.running / self.max_batch))])
            cumulative = [(f'{{le="{b:g}"}}', n) for b, n in zip(TTFT_BUCKETS, self.ttft_buckets)]
            lines.append("# HELP k3jax_time_to_first_token_seconds Time from submission to the first token.")
            lines.append("# TYPE k3jax_time_to_first_token_seconds histogram")
            lines.extend(f"k3jax_time_to_first_token_seconds_bucket{labels} {n}" for labels, n in cumulative)
            lines.append(f'k3jax_time_to_first_token_seconds_bucket{{le="+Inf"}} {self.ttft_count}')
            lines.append(f"k3jax_time_to_first_token_seconds_sum {self.ttft_sum:g}")
            lines.append(f"k3jax_time_to_first_token_seconds_count {self.ttft_count}")
            metric("prefix_cache_queries_total", "counter", "Prefix-cache lookups.", [("", self.prefix_queries)])
            metric("prefix_cache_hits_total", "counter", "Lookups that reused a prefix.", [("", self.prefix_hits)])
            metric("prefix_cache_hit_tokens_total", "counter", "Prompt tokens taken from the prefix cache.",
                   [("", self.prefix_hit_tokens)])
            hit_rate = self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
            metric("prefix_cache_hit_rate", "gauge", "Fraction of looked-up prompt tokens found in the prefix cache.",
                   [("", float(hit_rate))])
        return "\n".join(lines) + "\n"
