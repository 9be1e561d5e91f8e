"""The server's counters, served at /metrics in Prometheus' text format (prometheus_client)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.metrics_core import Metric

from ..speculative import GenerationResponse

WINDOW_S = 10.0  # tokens per second are counted over the last this many seconds


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "dflash_mlx_requests",
            "HTTP requests answered, by API and status code",
            ["api", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "dflash_mlx_prompt_tokens", "Prompt tokens of requests started", registry=r
        )
        self.cached_tokens = Counter(
            "dflash_mlx_cached_prompt_tokens",
            "Prompt tokens a kept cache already held (not prefilled)",
            registry=r,
        )
        self.generated = Counter("dflash_mlx_generated_tokens", "Tokens generated", registry=r)
        self.busy = Counter(
            "dflash_mlx_busy_seconds",
            "Seconds the generation worker spent prefilling and decoding",
            registry=r,
        )
        self.cycles = Counter(
            "dflash_mlx_cycles", "Speculative cycles, by what proposed their tokens", ["source"], registry=r
        )
        self.cycle_tokens = Counter(
            "dflash_mlx_cycle_accepted_tokens",
            "Tokens the target accepted in those cycles (divided by cycles: the acceptance length tau)",
            ["source"],
            registry=r,
        )
        self.stream_errors = Counter(
            "dflash_mlx_stream_errors",
            "Streamed answers that ended in an error event (counted as 200s in dflash_mlx_requests: the "
            "status was sent before), by API and the error's status",
            ["api", "status"],
            registry=r,
        )
        self.cancelled = Counter(
            "dflash_mlx_cancelled_requests",
            "Requests stopped because their client went away (or stopped reading), waiting or answering",
            registry=r,
        )
        self.cache_lookups = Counter(
            "dflash_mlx_prefix_cache_lookups",
            "Prompt-cache lookups, by result (hit or miss)",
            ["result"],
            registry=r,
        )
        self.evictions = Counter(
            "dflash_mlx_prefix_cache_evictions", "Kept caches dropped to stay within --cache-gb", registry=r
        )
        self.cache_bytes = Gauge("dflash_mlx_prefix_cache_bytes", "Bytes the kept caches hold", registry=r)
        self.cache_entries = Gauge("dflash_mlx_prefix_cache_entries", "Kept caches", registry=r)
        self.steps = Counter(
            "dflash_mlx_steps",
            "Engine steps, by kind: plain (every sequence a plain step) or speculative",
            ["kind"],
            registry=r,
        )
        self.step_sequences = Counter(
            "dflash_mlx_step_sequences",
            "Sequences in engine steps, all steps together (divided by steps: the mean batch size)",
            registry=r,
        )
        self.batch_size = Gauge("dflash_mlx_batch_size", "Sequences in the last engine step", registry=r)
        self.timed_out = Counter(
            "dflash_mlx_timed_out_requests", "Requests ended at --request-timeout", registry=r
        )
        self.waiting = Gauge("dflash_mlx_queue_length", "Requests waiting for a slot", registry=r)
        self.active = Gauge("dflash_mlx_active_requests", "Requests being generated", registry=r)
        tps = Gauge(
            "dflash_mlx_tokens_per_second",
            f"Tokens generated per second over the last {WINDOW_S:g} seconds, all requests together",
            registry=r,
        )
        tps.set_function(self._tokens_per_second)
        self._recent: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()
        # other processes' metric families, added to these (`serve --processes`: server/processes.py)
        self.sources: list[Callable[[], list]] = []

    def record(self, response: GenerationResponse) -> None:
        """A response of the generation worker: its tokens, its cycle."""
        self.generated.inc(len(response.tokens))
        if response.accepted is not None:
            self.cycles.labels(response.source).inc()
            self.cycle_tokens.labels(response.source).inc(response.accepted)
        with self._lock:
            self._recent.append((time.monotonic(), len(response.tokens)))
            self._prune()

    def record_step(self, sequences: int, plain: bool) -> None:
        self.steps.labels("plain" if plain else "speculative").inc()
        self.step_sequences.inc(sequences)
        self.batch_size.set(sequences)

    def _prune(self) -> None:
        while self._recent and self._recent[0][0] < time.monotonic() - WINDOW_S:
            self._recent.popleft()

    def _tokens_per_second(self) -> float:
        with self._lock:
            self._prune()
            return sum(n for _, n in self._recent) / WINDOW_S

    def total(self, sample: str, **labels) -> float:
        """A sample's value, summed over the processes (0 where none has it)."""
        return sum(
            s.value
            for families in self._all()
            for family in families
            for s in family.samples
            if s.name == sample and s.labels == labels
        )

    def text(self) -> bytes:
        return generate_latest(_Summed(self._all()) if self.sources else self.registry)

    def _all(self) -> list:
        """Each process's metric families, this one's first."""
        return [self.registry.collect(), *(source() for source in self.sources)]


class _Summed:
    """Metric families of several processes as one collector: each sample the sum of theirs (the
    earliest of their `_created` times). (prometheus_client's own multiprocess mode needs its folder and
    environment set before it is imported: too much for a few counters.)"""

    def __init__(self, sources):
        self.sources = sources

    def collect(self):
        families: dict[str, Metric] = {}
        values: dict[str, dict] = {}
        for family in (f for source in self.sources for f in source):
            if family.name not in families:
                families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                values[family.name] = {}
            summed = values[family.name]
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                last = summed.get(key)
                if last is None:
                    summed[key] = sample.value
                else:
                    created = sample.name.endswith("_created")
                    summed[key] = min(last, sample.value) if created else last + sample.value
        for name, family in families.items():
            for (sample, labels), value in values[name].items():
                family.add_sample(sample, dict(labels), value)
            yield family
