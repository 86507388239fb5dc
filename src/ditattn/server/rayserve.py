"""``ditattn serve --replicas N`` on Ray Serve: N replicas of the OpenAI server behind one HTTP
endpoint.

Each replica is a Ray Serve deployment replica that loads the pipeline once and serves the same
FastAPI app as ``ditattn serve`` (same routes, auth, limits, metrics), with a
:class:`~ditattn.server.cluster.ClusterState`: video jobs and outputs go through the shared
PostgreSQL job store and the shared ``--output-dir``.  Ray's HTTP proxy is the one ingress; it sends
each request to the less busy of two sampled replicas (requests in flight).  A replica takes ``2 ×
max_batch_size + 2`` requests at once (a batch running, the next one forming, and a poll or two);
beyond that requests wait at the proxy, up to ``replicas × max_queue`` for the whole deployment,
and the next one is answered 429 with ``Retry-After`` (Ray Serve's backpressure response).

Python entry point: :func:`deploy` (``ray.init`` + ``serve.run``), or :func:`build_app` for a
``serve.run`` of your own.  Resources: a replica declares ``num_gpus`` (its ``--num-gpus``, one) on
a GPU cluster and ``num_cpus`` (``cpus_per_replica``) on the CPU.
"""
from __future__ import annotations

import logging
import os
import socket
from typing import Optional

from ditattn.errors import AttentionConfigError
from ditattn.runconfig import RunConfig

log = logging.getLogger("ditattn.server")
APP_NAME = "ditattn"
BACKPRESSURE_RETRY_AFTER_S = 5


def check_scale_options(cfg: RunConfig) -> None:
    """What a scaled-out server needs, checked before Ray starts: a PostgreSQL job store that
    answers, an output folder, one GPU (or the CPU) per replica."""
    from ditattn.server.jobstores import check_shared

    s = cfg.server
    check_shared(s)
    if cfg.parallel.num_gpus > 1:
        raise AttentionConfigError(f"--num-gpus {cfg.parallel.num_gpus} with --replicas: a replica runs on one GPU "
                                   "here; accepted: --num-gpus 1 (more replicas use more GPUs)")
    from ditattn.server.pgstore import PgJobStore

    PgJobStore(s.job_store, owner="ditattn-check").close()  # reachable, schema created (a clear error if not)


def replica_resources(cfg: RunConfig, cluster_gpus: float, cpus_per_replica: float = 1.0) -> dict:
    """Ray actor options of one replica: one GPU when the model runs on CUDA (``--device cuda...``,
    or no ``--device`` on a cluster with GPUs), else ``cpus_per_replica`` CPUs."""
    device = cfg.model.device
    on_gpu = device.startswith("cuda") if device else cluster_gpus > 0
    return {"num_gpus": 1, "num_cpus": 1} if on_gpu else {"num_cpus": cpus_per_replica}


def _replica_class():
    from ray import serve

    @serve.ingress()
    class DitReplica:
        """One replica: the pipeline and the OpenAI app over the shared job store."""

        def __init__(self, cfg: RunConfig, replicas: int, cpu_threads: Optional[int] = None):
            import torch

            from ditattn.server.runner import build_runner

            if cpu_threads:
                torch.set_num_threads(cpu_threads)
            logging.getLogger("ditattn.server").setLevel(logging.INFO)
            self.cfg, self.replicas = cfg, replicas
            self.runner = build_runner(cfg)
            tag = serve.get_replica_context().replica_id.unique_id
            self.owner = f"{socket.gethostname()}:{os.getpid()}:{tag}"

        def __serve_build_asgi_app__(self):
            from ditattn.server.app import create_app
            from ditattn.server.cluster import ClusterState

            state = ClusterState(self.runner, self.cfg.server, replicas=self.replicas, owner=self.owner)
            return create_app(self.runner, self.cfg.server, state=state)

    return DitReplica


def build_app(cfg: RunConfig, *, cluster_gpus: float = 0.0, cpus_per_replica: float = 1.0):
    """The Ray Serve application of ``cfg`` (``cfg.server.replicas`` replicas), for ``serve.run``."""
    from ray import serve
    from ray.serve.config import BackpressureConfig

    s = cfg.server
    actor = replica_resources(cfg, cluster_gpus, cpus_per_replica)
    threads = None if actor.get("num_gpus") else max(1, int(cpus_per_replica))
    deployment = serve.deployment(_replica_class()).options(
        name="DitReplica", num_replicas=s.replicas, ray_actor_options=actor,
        max_ongoing_requests=2 * s.max_batch_size + 2, max_queued_requests=s.replicas * s.max_queue,
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=BACKPRESSURE_RETRY_AFTER_S),
        graceful_shutdown_timeout_s=s.drain_timeout_s + 10, health_check_period_s=5, health_check_timeout_s=60)
    return deployment.bind(cfg, s.replicas, threads)


def deploy(cfg: RunConfig, *, cpus_per_replica: float = 1.0, ray_init: Optional[dict] = None) -> str:
    """Start (or join: ``cfg.server.ray_address``) Ray, run the deployment on
    ``cfg.server.host:port`` and wait until every replica is up; returns the endpoint's base URL.
    ``ray_init``: further ``ray.init`` arguments (e.g. ``num_cpus`` for a local instance)."""
    import ray
    from ray import serve

    check_scale_options(cfg)
    s = cfg.server
    if not ray.is_initialized():
        address = s.ray_address or "local"  # never an instance that happens to run here: --ray-address auto
        local = {"include_dashboard": False} if address == "local" else {}  # ray start --head has one
        ray.init(address=address, namespace="ditattn", **{**local, **(ray_init or {})})
    serve.start(http_options={"host": s.host, "port": s.port})
    app = build_app(cfg, cluster_gpus=ray.cluster_resources().get("GPU", 0.0), cpus_per_replica=cpus_per_replica)
    serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    return f"http://{s.host}:{s.port}"


def undeploy(stop_ray: bool = True) -> None:
    """Delete the application (replicas hand their unfinished jobs back) and, when ``stop_ray``,
    shut down Serve and this process's Ray connection."""
    import ray
    from ray import serve

    try:
        serve.delete(APP_NAME)
    finally:
        if stop_ray:
            serve.shutdown()
            ray.shutdown()
