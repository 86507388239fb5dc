"""Server metrics through the official Prometheus client (``prometheus_client``).

Each :class:`Metrics` owns its own registry (several apps may live in one process, e.g. tests);
``GET /metrics`` returns :meth:`Metrics.render` in the text exposition format.  Counters and
histograms are thread-safe (the HTTP handlers and the scheduler's worker update them).
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """The server's metric families.

    requests: HTTP requests by endpoint and status code; generations: finished generation requests
    by kind (image/video), outcome (ok/error) and attention backend; refusals: 400s caused by the
    attention settings, by field; batches / batch_size: scheduler batches and their sizes in
    requests; generation_seconds: wall time of each batch run; queue_depth / running: gauges read
    from the scheduler at scrape time.
    """

    def __init__(self, queue_depth: Callable[[], float] = lambda: 0, running: Callable[[], float] = lambda: 0):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("ditattn_http_requests", "HTTP requests by endpoint and status code.",
                                ("endpoint", "status"), registry=r)
        self.generations = Counter("ditattn_generations",
                                   "Finished generation requests by kind, outcome and DiT attention backend.",
                                   ("kind", "outcome", "attention_backend"), registry=r)
        self.images = Counter("ditattn_images_generated", "Images produced.", registry=r)
        self.videos = Counter("ditattn_videos_generated", "Videos produced.", registry=r)
        self.refusals = Counter("ditattn_attention_refusals",
                                "Requests refused (400) because of their attention settings, by field.", ("field",),
                                registry=r)
        self.queue_full = Counter("ditattn_queue_full", "Requests refused with 429 because the queue was full.",
                                  registry=r)
        self.batches = Counter("ditattn_batches", "Batches run by the scheduler, by outcome.", ("outcome",), registry=r)
        self.batch_size = Histogram("ditattn_batch_size", "Requests per scheduler batch.",
                                    buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.generation_seconds = Histogram("ditattn_batch_seconds", "Wall time of one batch run in seconds.",
                                            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300), registry=r)
        self.queue_depth = Gauge("ditattn_queue_depth", "Requests waiting in the queue.", registry=r)
        self.queue_depth.set_function(queue_depth)
        self.running = Gauge("ditattn_running_samples", "Samples in the batch now running.", registry=r)
        self.running.set_function(running)

    def render(self) -> bytes:
        """The registry in the Prometheus text exposition format."""
        return generate_latest(self.registry)


def samples(text: "str | bytes") -> list[tuple[str, dict, float]]:
    """Exposition text → ``[(sample name, labels, value)]`` (the official parser); for tests and
    quick checks."""
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    return [(s.name, dict(s.labels), s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def parse_text(text: "str | bytes") -> dict:
    """Exposition text → ``{'name{label="value",...}': value}`` with the labels in exposition order
    (sorted by name) and escaped as in the text."""
    out = {}
    for name, labels, value in samples(text):
        body = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        out[name + (f"{{{body}}}" if body else "")] = value
    return out
