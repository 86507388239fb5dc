"""``ditattn serve``: load the model, then run the OpenAI-compatible server until interrupted.

With ``--num-gpus N`` every rank loads the pipeline; rank 0 runs the HTTP server and relays each
pipeline call (:class:`~ditattn.distributed.relay.PipelineRelay`), the other ranks replay them.
"""

from __future__ import annotations

import logging
import socket

from ditattn.distributed.launch import RankInfo
from ditattn.entrypoints.ranks import needs_ranks, run_on_ranks
from ditattn.errors import AttentionConfigError
from ditattn.runconfig import RunConfig

log = logging.getLogger("ditattn.server")


def check_serve_options(cfg: RunConfig) -> None:
    """Before loading the model: refuse a seed or prompt (each request carries its own, so they
    would be ignored) and an address the server cannot bind (bad host, port in use)."""
    if cfg.sampling.seed is not None:
        raise AttentionConfigError(
            "--seed does not apply to serve; accepted: a 'seed' field in each request "
            "(requests without one get a random seed)"
        )
    if cfg.sampling.prompt is not None:
        raise AttentionConfigError("prompt does not apply to serve; accepted: a 'prompt' field in each request")
    if cfg.sampling.image is not None:
        raise AttentionConfigError(
            "--image does not apply to serve; accepted: an 'input_reference' image in each POST /v1/videos request"
        )
    host, port = cfg.server.host, cfg.server.port
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise AttentionConfigError(
            f"--host {host!r} cannot be resolved ({exc}); accepted: an IP address or "
            "host name of this machine, e.g. 127.0.0.1 or 0.0.0.0"
        ) from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as exc:
            raise AttentionConfigError(
                f"cannot listen on {host}:{port} ({exc.strerror or exc}); accepted: "
                "a free port and an address of this machine"
            ) from None


def run(cfg: RunConfig) -> int:
    """``ditattn serve``; user errors raise :class:`AttentionConfigError`."""
    from ditattn.extras import require

    require("server", "ditattn serve")
    check_serve_options(cfg)
    if cfg.model.backend != "native":
        raise AttentionConfigError(
            "ditattn serve runs the native pipeline only (per-request attention overrides "
            "need ditattn's attention layers); drop --backend diffusers"
        )
    if cfg.server.replicas > 1 or cfg.server.ray_address:  # replicas on Ray Serve behind one endpoint
        return serve_on_ray(cfg)
    if needs_ranks(cfg):  # one process per rank: rank 0 serves, the others follow
        return run_on_ranks(run_rank, cfg)
    return serve_here(cfg)


def serve_on_ray(cfg: RunConfig) -> int:
    """``serve --replicas N`` / ``--ray-address``: deploy on Ray Serve, then wait for SIGINT /
    SIGTERM, which deletes the deployment (each replica hands its unfinished video jobs back to the
    shared store) and stops the Ray instance this command started."""
    import signal
    import threading

    from ditattn.extras import MissingDependencyError, missing, require
    from ditattn.server.jobstores import check_shared, is_postgres

    if cfg.server.replicas > 1 or is_postgres(cfg.server.job_store):
        check_shared(cfg.server)  # the arguments first: what to pass is said before what to install
        require("scale", "ditattn serve --replicas")
    elif "ray[serve]" in missing("scale"):  # one replica over SQLite: Ray alone, no PostgreSQL client
        raise MissingDependencyError(
            "ditattn serve --ray-address needs ray[serve], which is not installed; install "
            "ditattn[scale] (pip install 'ditattn[scale]')"
        )
    from ditattn.server.pgstore import redact
    from ditattn.server.rayserve import deploy, undeploy

    log.setLevel(logging.INFO)
    if cfg.parallel.num_gpus > 1:  # each replica's ranks: refuse bad degrees / overrides before any replica loads
        from ditattn.entrypoints.ranks import preflight

        preflight(cfg)
    done = threading.Event()

    def on_signal(*_):
        done.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    url = deploy(cfg)
    for sig in (signal.SIGINT, signal.SIGTERM):  # again: ray.init installs handlers of its own
        signal.signal(sig, on_signal)
    s = cfg.server
    store = redact(s.job_store) if s.job_store else "sqlite (one replica)"
    print(
        f"ditattn serve: {s.replicas} replica(s) of {cfg.model.model_path or 'the model'} on {url} (Ray Serve"
        f"{' at ' + s.ray_address if s.ray_address else ', local Ray instance'}; job store "
        f"{store}; outputs in {s.output_dir or 'a temporary folder'}); Ctrl-C stops",
        flush=True,
    )
    while not done.wait(1.0):  # a timed wait: the signal handlers run between waits
        pass
    print("ditattn serve: stopping the replicas (unfinished video jobs go back to the shared store)", flush=True)
    undeploy(stop_ray=True)
    return 0


def serve_here(cfg: RunConfig) -> int:
    """Load the pipeline and serve it on ``cfg.server.host:port`` until a signal ends it (the
    first SIGTERM / Ctrl-C drains: :mod:`ditattn.server.lifecycle`)."""
    from ditattn.server import gcpause
    from ditattn.server.app import create_app
    from ditattn.server.connection import uvicorn_config
    from ditattn.server.lifecycle import DrainingServer
    from ditattn.server.runner import build_runner

    log.setLevel(logging.INFO)  # a server's operational lines (job store, drain, removed files) are shown
    runner = build_runner(cfg)
    state = None
    from ditattn.server.jobstores import is_postgres

    if is_postgres(cfg.server.job_store):  # a shared store: this process is one replica among others
        from ditattn.server.cluster import ClusterState

        state = ClusterState(runner, cfg.server)
    app = create_app(runner, cfg.server, state=state)  # opens the job store (error: in use, foreign file)
    state = app.state.server
    host, port = cfg.server.host, cfg.server.port
    if host not in ("127.0.0.1", "localhost", "::1") and not cfg.server.api_key:
        log.warning(
            "serving on %s without --api-key: anyone who can reach this address can use the server (web "
            "pages cannot: requests must name it by IP address, localhost, --public-url or --allowed-hosts)",
            host,
        )
    where = (
        f"outputs and job store in {state.output_dir}"
        if cfg.server.output_dir
        else "no --output-dir: outputs in a temporary folder, video jobs are not kept across restarts"
    )
    q = runner.pipe.quantization_summary()  # per process: every request runs these linears
    linears = f"; DiT linears: {q}" if q else ""
    print(
        f"ditattn serve: model {runner.model_id} on http://{host}:{port} "
        f"(DiT attention: {', '.join(runner.default_backends())}{linears}; {where})",
        flush=True,
    )
    config = uvicorn_config(
        app, cfg.server, log_level="info" if cfg.verbose else "warning", timeout_graceful_shutdown=5
    )
    server = DrainingServer(config, state)  # h11 with read timeouts and half-close support (server.connection)
    gcpause.freeze_loaded()  # later collections skip the loaded pipeline and modules (server.gcpause)
    server.run()
    return 0


def run_rank(rank: RankInfo, cfg: RunConfig) -> int:
    """One rank of ``serve --num-gpus N``: rank 0 serves with its pipeline calls relayed; the
    other ranks build the same pipeline and replay them."""
    from ditattn.distributed.relay import PipelineRelay
    from ditattn.pipelines.wan import WanPipelineNative

    cfg = cfg.for_rank(rank.rank, rank.device)
    relay = PipelineRelay()
    if rank.rank == 0:
        with relay.leading(WanPipelineNative):
            return serve_here(cfg)
    relay.follow(WanPipelineNative.from_config(cfg))
    return 0
