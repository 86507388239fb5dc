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
``serve.run`` of your own.  Resources: a replica declares ``num_gpus`` (its ``--num-gpus``) on a
GPU cluster and ``num_cpus`` (``cpus_per_replica``) on the CPU.  A replica of ``--num-gpus N`` > 1
keeps the single-host sequence parallelism inside it: it is rank 0 of its own group of N ranks
(NCCL on its GPUs, gloo on the CPU) and relays each pipeline call to the others
(:func:`ditattn.server.runner.open_runner`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from typing import Optional

from ditattn.errors import AttentionConfigError
from ditattn.runconfig import RunConfig

log = logging.getLogger("ditattn.server")
APP_NAME = "ditattn"
BACKPRESSURE_RETRY_AFTER_S = 5
#: Ray starts its worker processes (the replicas, Serve's proxy and controller) at niceness 15 unless this
#: variable (or the ``worker_niceness`` system setting) says otherwise
NICENESS_ENV = "RAY_worker_niceness"


def local_system_config() -> dict:
    """Ray system settings of a local instance that :func:`deploy` starts: workers at niceness 0, so that
    a replica and the proxy in front of it are not the node's lowest-priority processes (docs/serving.md,
    "Niceness").  ``{}`` when ``RAY_worker_niceness`` is set: the user's choice stands."""
    return {} if NICENESS_ENV in os.environ else {"worker_niceness": 0}


def raise_priority() -> Optional[str]:
    """Run every thread of this process at niceness 0 when it runs above 0 (a replica on a cluster
    started by ``ray start`` without ``RAY_worker_niceness=0``); threads started later inherit it.
    Returns None when the process runs at 0 (now or already), else why it could not (lowering a
    niceness needs ``CAP_SYS_NICE``), with the fix.  Leaves a niceness the user chose
    (``RAY_worker_niceness`` in the environment) alone."""
    if NICENESS_ENV in os.environ or not hasattr(os, "setpriority"):
        return None
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]  # no /proc: this thread only
    nice = []
    for t in tids:
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            nice.append(os.getpriority(os.PRIO_PROCESS, t))
    before = max(nice, default=0)
    if before <= 0:
        return None
    try:
        for t in tids:
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.setpriority(os.PRIO_PROCESS, t, 0)  # on Linux a "process" here is one thread
    except PermissionError:
        return (
            f"this replica runs at niceness {before} (Ray's default for its workers) and may not lower it "
            f"(no CAP_SYS_NICE): any busier process on the node runs first, which adds latency to every request; "
            f"start Ray with {NICENESS_ENV}=0 (e.g. `{NICENESS_ENV}=0 ray start --head`)"
        )
    return None


def check_scale_options(cfg: RunConfig) -> None:
    """What a scaled-out server needs, checked before Ray starts: a PostgreSQL job store that
    answers and an output folder (one replica alone may keep the SQLite store), sequence-parallel degrees that fit
    ``--num-gpus`` (the ranks of a
    replica)."""
    from ditattn.server.jobstores import check_shared, is_postgres

    s = cfg.server
    cfg.parallel.degrees()  # --ulysses-degree x --ring-degree (x 2 with --cfg-parallel) must be --num-gpus
    if s.replicas == 1 and not is_postgres(s.job_store):
        return  # one replica behind Ray's proxy may keep the single server's SQLite store
    check_shared(s)
    from ditattn.server.pgstore import PgJobStore

    PgJobStore(s.job_store, owner="ditattn-check").close()  # reachable, schema created (a clear error if not)


def check_cluster_fits(cfg: RunConfig, node_gpus: list) -> None:
    """Refuse (AttentionConfigError) a GPU deployment whose replicas cannot all be placed: each
    replica's ``--num-gpus`` ranks share one host, so ``node_gpus`` (the GPUs of each Ray node) must
    hold ``--replicas`` groups of ``--num-gpus``.  Nothing to check when no node has a GPU."""
    n, want = cfg.parallel.num_gpus, cfg.server.replicas
    on_gpu = cfg.model.device.startswith("cuda") if cfg.model.device else any(node_gpus)
    if not on_gpu:
        return
    fits = sum(int(g // n) for g in node_gpus)
    if fits < want:
        raise AttentionConfigError(
            f"--replicas {want} x --num-gpus {n} does not fit this Ray cluster (GPUs per node: "
            f"{', '.join(f'{g:g}' for g in node_gpus) or 'none'}): a replica's ranks share one node; accepted: "
            f"at most {fits} replica(s) of --num-gpus {n}"
        )


def replica_resources(cfg: RunConfig, cluster_gpus: float, cpus_per_replica: float = 1.0) -> dict:
    """Ray actor options of one replica: ``--num-gpus`` GPUs (its sequence-parallel ranks) when the
    model runs on CUDA (``--device cuda...``, or no ``--device`` on a cluster with GPUs), else
    ``cpus_per_replica`` CPUs (the ranks, if several, are gloo processes sharing them)."""
    device = cfg.model.device
    on_gpu = device.startswith("cuda") if device else cluster_gpus > 0
    return {"num_gpus": cfg.parallel.num_gpus, "num_cpus": 1} if on_gpu else {"num_cpus": cpus_per_replica}


def cpus_per_replica_for(replicas: int, node_cpus: list) -> int:
    """The CPUs each CPU replica declares, and the torch threads it runs, when the caller names none:
    the cluster's CPUs shared evenly among the replicas, at most one node's, at least one (on 2 cores:
    one replica runs 2 threads, two replicas 1 each, so that they do not contend)."""
    total, biggest = sum(node_cpus), max(node_cpus, default=1)
    return max(1, min(int(biggest), int(total // max(1, replicas))))


def cpu_threads_per_gpu(nodes: list) -> int:
    """The torch CPU threads a GPU replica runs per GPU it holds: the fewest CPUs per GPU among the
    cluster's GPU nodes, ``nodes`` being ``(cpus, gpus)`` per alive node (1 when none has a GPU).

    Ray starts its worker processes with ``OMP_NUM_THREADS=1`` (unless that variable is set where Ray
    started), so a GPU replica would otherwise run the pipeline's CPU-side work on one thread where
    ``ditattn serve`` uses every core of its host (docs/serving.md, "Threads")."""
    ratios = [cpus / gpus for cpus, gpus in nodes if gpus > 0]
    return max(1, int(min(ratios))) if ratios else 1


def _replica_class():
    from ray import serve

    @serve.ingress()
    class DitReplica:
        """One replica: the pipeline and the OpenAI app over the shared job store."""

        def __init__(self, cfg: RunConfig, replicas: int, cpu_threads: Optional[int] = None):
            import torch

            logging.getLogger("ditattn.server").setLevel(logging.INFO)
            why = raise_priority()  # before the pipeline's threads start: they inherit it
            if why:
                log.warning("%s", why)
            if cpu_threads:
                torch.set_num_threads(cpu_threads)
            self.cfg, self.replicas = cfg, replicas
            self._ranks = contextlib.ExitStack()  # the replica's pipeline process or sequence-parallel ranks
            if cfg.server.replica_process:  # the pipeline in a child process (server.pipehost)
                from ditattn.server.pipehost import HostedRunner

                self.runner = HostedRunner(cfg, threads=cpu_threads)
                self._ranks.callback(self.runner.close)
            else:
                from ditattn.server.runner import open_runner

                log.info("replica: the pipeline runs here (%d torch CPU threads)", torch.get_num_threads())
                self.runner = open_runner(cfg, self._ranks)
            tag = serve.get_replica_context().replica_id.unique_id
            self.owner = f"{socket.gethostname()}:{os.getpid()}:{tag}"

        def __serve_build_asgi_app__(self):
            from ditattn.server import gcpause
            from ditattn.server.app import create_app
            from ditattn.server.cluster import ClusterState
            from ditattn.server.jobstores import is_postgres

            state = None  # one replica over SQLite: the single server's state
            if is_postgres(self.cfg.server.job_store):
                state = ClusterState(self.runner, self.cfg.server, replicas=self.replicas, owner=self.owner)
            app = create_app(self.runner, self.cfg.server, state=state)
            gcpause.freeze_loaded()  # later collections skip the pipeline and Ray's modules (server.gcpause)
            return app

        def check_health(self):
            """Ray Serve's health check: a replica whose pipeline process ended is restarted."""
            why = getattr(self.runner, "exit_reason", lambda: None)()
            if why:
                raise RuntimeError(why)

        def __del__(self):
            self._ranks.close()

    return DitReplica


def build_app(
    cfg: RunConfig, *, cluster_gpus: float = 0.0, cpus_per_replica: float = 1.0, cpus_per_gpu: Optional[int] = None
):
    """The Ray Serve application of ``cfg`` (``cfg.server.replicas`` replicas), for ``serve.run``.
    A CPU replica runs ``cpus_per_replica`` torch threads, a GPU replica ``cpus_per_gpu`` per GPU (default:
    :func:`cpu_threads_per_gpu` of the connected Ray cluster); an ``OMP_NUM_THREADS`` set here wins."""
    from ray import serve
    from ray.serve.config import BackpressureConfig

    s = cfg.server
    actor = replica_resources(cfg, cluster_gpus, cpus_per_replica)
    # an OMP_NUM_THREADS set where Ray started wins (the replicas inherit it); else the replica's share of the cores
    if os.environ.get("OMP_NUM_THREADS"):
        threads = None
    elif actor.get("num_gpus"):
        if cpus_per_gpu is None:
            cpus_per_gpu = cpu_threads_per_gpu(_node_resources())
        threads = max(1, int(cpus_per_gpu)) * max(1, int(actor["num_gpus"]))
    else:
        threads = max(1, int(cpus_per_replica))
    deployment = serve.deployment(_replica_class()).options(
        name="DitReplica",
        num_replicas=s.replicas,
        ray_actor_options=actor,
        max_ongoing_requests=2 * s.max_batch_size + 2,
        max_queued_requests=s.replicas * s.max_queue,
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=BACKPRESSURE_RETRY_AFTER_S),
        graceful_shutdown_timeout_s=s.drain_timeout_s + 10,
        health_check_period_s=5,
        health_check_timeout_s=60,
        logging_config={"enable_access_log": False},
    )  # the server logs what matters; a line per request costs CPU
    return deployment.bind(cfg, s.replicas, threads)


def deploy(cfg: RunConfig, *, cpus_per_replica: Optional[float] = None, ray_init: Optional[dict] = None) -> str:
    """Start (or join: ``cfg.server.ray_address``) Ray, run the deployment on
    ``cfg.server.host:port`` and wait until every replica is up; returns the endpoint's base URL.
    ``cpus_per_replica`` (CPU replicas; also their torch threads): default :func:`cpus_per_replica_for`.
    AttentionConfigError when the replicas do not fit the cluster (:func:`check_cluster_fits`).
    ``ray_init``: further ``ray.init`` arguments (e.g. ``num_cpus`` for a local instance)."""
    import ray
    from ray import serve

    check_scale_options(cfg)
    s = cfg.server
    if not ray.is_initialized():
        address = s.ray_address or "local"  # never an instance that happens to run here: --ray-address auto
        local = {}
        if address == "local":  # ray start --head has a dashboard; its workers' niceness is set there
            local = {"include_dashboard": False, "_system_config": local_system_config()}
        try:
            ray.init(address=address, namespace="ditattn", **{**local, **(ray_init or {})})
        except ConnectionError as exc:  # --ray-address names no running cluster
            raise AttentionConfigError(
                f"--ray-address {address}: no Ray cluster answers there ({' '.join(str(exc).split())[:160]}); "
                "start one with 'ray start --head' (or pass the head's HOST:6379), or leave --ray-address out "
                "for a local instance"
            ) from None
    check_cluster_fits(cfg, [n.get("Resources", {}).get("GPU", 0.0) for n in ray.nodes() if n.get("Alive")])
    start_proxy(serve, s.host, s.port)
    if cpus_per_replica is None:
        cpus_per_replica = cpus_per_replica_for(
            s.replicas, [n.get("Resources", {}).get("CPU", 0.0) for n in ray.nodes() if n.get("Alive")]
        )
    app = build_app(cfg, cluster_gpus=ray.cluster_resources().get("GPU", 0.0), cpus_per_replica=cpus_per_replica)
    serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    return f"http://{s.host}:{s.port}"


def _node_resources() -> list:
    """``(cpus, gpus)`` of each alive node of the connected Ray cluster (``[]`` when Ray is not initialised)."""
    import ray

    if not ray.is_initialized():
        return []
    res = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    return [(r.get("CPU", 0.0), r.get("GPU", 0.0)) for r in res]


def start_proxy(serve, host: str, port: int) -> None:
    """``serve.start`` on ``host:port``; a proxy that cannot bind the address (taken since ``ditattn serve``
    checked it: by another program, or by one of Ray's own processes, which bind free ports as they start)
    shuts Serve and this process's Ray down and raises :class:`AttentionConfigError` saying so."""
    try:
        serve.start(http_options={"host": host, "port": port}, logging_config={"enable_access_log": False})
    except Exception as exc:
        text = " ".join(str(exc).split())
        if "Failed to bind" not in text and "already in use" not in text:
            raise
        import ray

        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
        raise AttentionConfigError(
            f"cannot listen on {host}:{port}: Ray Serve's proxy could not bind it (address in use: taken after "
            "ditattn serve checked it, by another program or one of Ray's own processes); accepted: a free "
            "port (--port) below the ephemeral range (/proc/sys/net/ipv4/ip_local_port_range) and outside "
            "Ray's own ports (6379, 8265, 10001-19999), e.g. 30000"
        ) from None


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
