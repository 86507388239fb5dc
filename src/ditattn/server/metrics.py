"""Server metrics in the Prometheus text exposition format (version 0.0.4), hand-written.

Counters and histograms are thread-safe (the HTTP handlers and the scheduler's worker update them).
``GET /metrics`` returns :meth:`Metrics.render`.
"""
from __future__ import annotations

import math
import threading
from typing import Callable, Iterable, Optional

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: tuple, values: tuple, extra: Optional[tuple] = None) -> str:
    pairs = list(zip(names, values))
    if extra:
        pairs.append(extra)
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in pairs) + "}"


def _num(x: float) -> str:
    if isinstance(x, int):
        return str(x)
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x))


class _Family:
    def __init__(self, name: str, help: str, kind: str, labelnames: Iterable[str] = ()):
        self.name, self.help, self.kind = name, help, kind
        self.labelnames = tuple(labelnames)
        self._lock = threading.Lock()

    def _key(self, labels: dict) -> tuple:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name}: labels {sorted(labels)} != {list(self.labelnames)}")
        return tuple(str(labels[n]) for n in self.labelnames)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Family):
    """A monotonically increasing count per label set."""

    def __init__(self, name, help, labelnames=()):
        super().__init__(name, help, "counter", labelnames)
        self._values: dict[tuple, float] = {}

    def inc(self, amount: float = 1, **labels) -> None:
        if amount < 0:
            raise ValueError("counters only go up")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0) + amount

    def value(self, **labels) -> float:
        with self._lock:
            return self._values.get(self._key(labels), 0)

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        lines = self.header()
        if not items and not self.labelnames:
            items = [((), 0)]
        lines += [f"{self.name}{_labels(self.labelnames, k)} {_num(v)}" for k, v in items]
        return lines


class Gauge(_Family):
    """A value read from a callable at render time (queue depth, …)."""

    def __init__(self, name, help, fn: Callable[[], float]):
        super().__init__(name, help, "gauge")
        self.fn = fn

    def render(self) -> list[str]:
        try:
            v = self.fn()
        except Exception:  # a gauge must never break /metrics
            v = float("nan")
        return self.header() + [f"{self.name} {_num(v)}"]


class Histogram(_Family):
    """Cumulative buckets, ``_sum`` and ``_count`` per label set."""

    def __init__(self, name, help, buckets: Iterable[float], labelnames=()):
        super().__init__(name, help, "histogram", labelnames)
        self.buckets = tuple(sorted(buckets)) + (float("inf"),)
        self._data: dict[tuple, list] = {}  # key -> [counts per bucket, sum, count]

    def observe(self, value: float, **labels) -> None:
        key = self._key(labels)
        with self._lock:
            d = self._data.setdefault(key, [[0] * len(self.buckets), 0.0, 0])
            for i, b in enumerate(self.buckets):
                if value <= b:
                    d[0][i] += 1
            d[1] += value
            d[2] += 1

    def count(self, **labels) -> int:
        with self._lock:
            d = self._data.get(self._key(labels))
            return d[2] if d else 0

    def render(self) -> list[str]:
        with self._lock:
            items = sorted((k, ([*v[0]], v[1], v[2])) for k, v in self._data.items())
        lines = self.header()
        for key, (counts, total, n) in items:
            for b, c in zip(self.buckets, counts):
                le = "+Inf" if math.isinf(b) else _num(float(b))
                lines.append(f"{self.name}_bucket{_labels(self.labelnames, key, ('le', le))} {c}")
            lines.append(f"{self.name}_sum{_labels(self.labelnames, key)} {_num(float(total))}")
            lines.append(f"{self.name}_count{_labels(self.labelnames, key)} {n}")
        return lines


class Metrics:
    """The server's metric families.

    requests: HTTP requests by endpoint and status code; generations: finished generation requests
    by kind (image/video), outcome (ok/error) and attention backend; refusals: 400s caused by the
    attention settings, by reason code; batches / batch_size: scheduler batches and their sizes in
    requests; generation_seconds: wall time of each batch run; queue_depth / running: gauges.
    """

    def __init__(self, queue_depth: Callable[[], float] = lambda: 0, running: Callable[[], float] = lambda: 0):
        self.requests = Counter("ditattn_http_requests_total", "HTTP requests by endpoint and status code.",
                                ("endpoint", "status"))
        self.generations = Counter("ditattn_generations_total",
                                   "Finished generation requests by kind, outcome and DiT attention backend.",
                                   ("kind", "outcome", "attention_backend"))
        self.images = Counter("ditattn_images_generated_total", "Images produced.")
        self.videos = Counter("ditattn_videos_generated_total", "Videos produced.")
        self.refusals = Counter("ditattn_attention_refusals_total",
                                "Requests refused (400) because of their attention settings, by field.", ("field",))
        self.queue_full = Counter("ditattn_queue_full_total", "Requests refused with 429 because the queue was full.")
        self.batches = Counter("ditattn_batches_total", "Batches run by the scheduler, by outcome.", ("outcome",))
        self.batch_size = Histogram("ditattn_batch_size", "Requests per scheduler batch.",
                                    (1, 2, 4, 8, 16, 32, 64))
        self.generation_seconds = Histogram("ditattn_batch_seconds", "Wall time of one batch run in seconds.",
                                            (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        self.queue_depth = Gauge("ditattn_queue_depth", "Requests waiting in the queue.", queue_depth)
        self.running = Gauge("ditattn_running_samples", "Samples in the batch now running.", running)

    def families(self) -> list:
        return [self.requests, self.generations, self.images, self.videos, self.refusals, self.queue_full,
                self.batches, self.batch_size, self.generation_seconds, self.queue_depth, self.running]

    def render(self) -> str:
        lines: list[str] = []
        for fam in self.families():
            lines.extend(fam.render())
        return "\n".join(lines) + "\n"


def parse_text(text: str) -> dict:
    """Parse exposition text into ``{"name{labels}": value}`` (tests and quick checks)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, val = line.rpartition(" ")
        out[key] = float(val)
    return out
