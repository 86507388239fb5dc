"""Server metrics through the official Prometheus client (``prometheus_client``).

Each :class:`Metrics` owns its own registry (several apps may live in one process, e.g. tests);
``GET /metrics`` returns :meth:`Metrics.render` in the text exposition format.  Counters and
histograms are thread-safe (the HTTP handlers and the scheduler's worker update them).
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """The server's metric families.

    requests: HTTP requests by endpoint and status code; generations: finished generation requests
    by kind (image/video), outcome (ok/error) and attention backend; refusals: 400s caused by the
    attention settings, by field; cancelled: requests stopped before they finished, by kind, reason
    (``client_disconnected``, ``deleted``, ``timeout``, ``shutdown``) and stage (``queued``: never
    computed; ``running``: stopped at a denoising step or its result dropped); batches /
    batch_size: scheduler batches and their sizes in requests; generation_seconds: wall time of
    each batch run; queue_depth / running / running_age / draining: gauges read at scrape time.
    """

    def __init__(
        self,
        queue_depth: Callable[[], float] = lambda: 0,
        running: Callable[[], float] = lambda: 0,
        running_age: Callable[[], float] = lambda: 0,
        draining: Callable[[], float] = lambda: 0,
    ):
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "ditattn_http_requests", "HTTP requests by endpoint and status code.", ("endpoint", "status"), registry=r
        )
        self.generations = Counter(
            "ditattn_generations",
            "Finished generation requests by kind, outcome and DiT attention backend.",
            ("kind", "outcome", "attention_backend"),
            registry=r,
        )
        self.images = Counter("ditattn_images_generated", "Images produced.", registry=r)
        self.videos = Counter("ditattn_videos_generated", "Videos produced.", registry=r)
        self.refusals = Counter(
            "ditattn_attention_refusals",
            "Requests refused (400) because of their attention settings, by field.",
            ("field",),
            registry=r,
        )
        self.queue_full = Counter(
            "ditattn_queue_full", "Requests refused with 429 because the queue was full.", registry=r
        )
        self.cancelled = Counter(
            "ditattn_requests_cancelled",
            "Requests stopped before they finished, by kind, reason and stage.",
            ("kind", "reason", "stage"),
            registry=r,
        )
        self.batches = Counter(
            "ditattn_batches",
            "Batches run by the scheduler, by outcome (ok, error, cancelled).",
            ("outcome",),
            registry=r,
        )
        self.batch_size = Histogram(
            "ditattn_batch_size", "Requests per scheduler batch.", buckets=(1, 2, 4, 8, 16, 32, 64), registry=r
        )
        self.generation_seconds = Histogram(
            "ditattn_batch_seconds",
            "Wall time of one batch run in seconds.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=r,
        )
        self.queue_depth = Gauge("ditattn_queue_depth", "Requests waiting in the queue.", registry=r)
        self.queue_depth.set_function(queue_depth)
        self.running = Gauge("ditattn_running_samples", "Samples in the batch now running.", registry=r)
        self.running.set_function(running)
        self.running_age = Gauge(
            "ditattn_running_batch_age_seconds", "Seconds the running batch has run (0: idle).", registry=r
        )
        self.running_age.set_function(running_age)
        self.draining = Gauge("ditattn_draining", "1 while the server drains for a shutdown.", registry=r)
        self.draining.set_function(draining)

    def render(self) -> bytes:
        """The registry in the Prometheus text exposition format."""
        return generate_latest(self.registry)


class _Families:
    """A collector that yields fixed metric families (for :func:`deployment_view`)."""

    def __init__(self, families: list):
        self.families = families

    def collect(self):
        return self.families


def deployment_view(texts: dict, label: str = "replica") -> bytes:
    """One exposition for a whole deployment: ``texts`` maps each replica's id to its own exposition
    text; every sample gets a ``replica`` label (sum over it in queries for the deployment's totals),
    families of the same name are merged, and ``ditattn_replicas_reporting`` counts the replicas."""
    merged: dict = {}
    for rid, text in texts.items():
        for fam in text_string_to_metric_families(text.decode("utf-8") if isinstance(text, bytes) else text):
            m = merged.get(fam.name)
            if m is None:
                m = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            m.samples.extend(s._replace(labels={label: str(rid), **s.labels}) for s in fam.samples)
    up = Metric("ditattn_replicas_reporting", "Replicas whose metrics this view holds.", "gauge")
    up.add_sample("ditattn_replicas_reporting", {}, float(len(texts)))
    reg = CollectorRegistry(auto_describe=True)
    reg.register(_Families([*merged.values(), up]))
    return generate_latest(reg)


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
