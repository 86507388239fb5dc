"""The sections of the run configuration that one command reads: :class:`ServerConfig`
(``serve``), :class:`SimulationConfig` (``plan`` / ``backends``), :class:`BackendsOptions`
(``backends``) and :class:`CompareOptions` (``compare``).  Part of
:class:`~ditattn.runconfig.RunConfig`; importable from :mod:`ditattn.runconfig`."""

from __future__ import annotations

import dataclasses
from typing import Optional

from ditattn.errors import AttentionConfigError
from ditattn.runconfig.checks import (
    boolean,
    float_between,
    int_between,
    integer,
    job_store_url,
    list_of,
    nonempty_text,
    nonneg_int,
    optional,
    package_list,
    platform_spec,
    public_url,
    tcp_port,
    text,
    text_items,
    web_origin,
)
from ditattn.runconfig.fields import MAX_FPS, MAX_FRAMES, MAX_SIDE, MAX_STEPS
from ditattn.runconfig.fields import Section as _Section
from ditattn.runconfig.fields import setting as _field


@dataclasses.dataclass(frozen=True)
class ServerConfig(_Section):
    """``serve``: address, batching, request limits and lifecycle.

    api_key: required bearer token (None = open); max_batch_size / max_queue: scheduler bounds;
    request_timeout_s: a request is stopped (at its next denoising step) this long after it was
    accepted (image requests get 504; a video job fails with ``timeout``, counted from its start);
    output_dir: where MP4/PNG outputs and the video job store (``jobs.sqlite``) live, reloaded by
    the next start with the same folder (None = a private temporary folder removed at shutdown);
    public_url: the external base URL of image URLs (None: relative URLs); max_*: request limits
    (400 beyond them, naming the limit), ``max_output_pixels`` bounding width × height × frames ×
    n (None: 16 × the model's default output, at most a 720p 81-frame clip); max_videos_kept: the oldest finished video
    jobs (and files) are forgotten beyond this count;
    batch_window_s: how long the scheduler waits for more requests to batch; drain_timeout_s: after
    SIGTERM, how long the running job may take to finish before it is stopped and kept queued;
    allowed_hosts / allowed_origins: without an API key, the ``Host`` names and browser ``Origin``s
    answered besides the local ones (a web page elsewhere cannot drive the server); header_timeout_s /
    body_timeout_s: a connection that stalls while sending a request is closed;
    replicas / replica_process / ray_address / job_store / job_lease_s / job_max_attempts: scale-out on Ray
    Serve over a shared PostgreSQL job store (``ditattn.server.rayserve``, ``ditattn.server.cluster``).
    """

    host: str = _field("127.0.0.1", text, "bind address", metavar="HOST")
    port: int = _field(30000, tcp_port, "TCP port", metavar="PORT")
    api_key: Optional[str] = _field(None, optional(nonempty_text), "require Authorization: Bearer KEY", metavar="KEY")
    public_url: Optional[str] = _field(
        None,
        optional(public_url),
        "external base URL of this server (e.g. https://img.example.com); image URLs "
        "are built from it (default: relative URLs, never from the request's Host "
        "header)",
        metavar="URL",
    )
    max_batch_size: int = _field(4, int_between(1, 1024), "dynamic batching: requests per batch", metavar="B")
    max_queue: int = _field(64, int_between(1, 100000), "queued requests before 429", metavar="N")
    request_timeout_s: float = _field(
        600.0,
        float_between(0.0, 7 * 86400.0, lo_open=True),
        "a request is stopped at its next denoising step this long after it was "
        "accepted (image: 504; video job: failed with 'timeout', counted from its "
        "start)",
        metavar="S",
    )
    drain_timeout_s: float = _field(
        20.0,
        float_between(0.0, 86400.0),
        "after SIGTERM: seconds the running job may take to finish before it is stopped "
        "at its next step and kept queued for the next start; a second SIGTERM exits at "
        "once",
        metavar="S",
    )
    output_dir: Optional[str] = _field(
        None,
        optional(text),
        "where outputs and the video job store (jobs.sqlite) live; a restart with the "
        "same folder re-queues unfinished video jobs and serves finished ones "
        "(default: a temporary folder removed at shutdown)",
        metavar="DIR",
    )
    max_side: int = _field(2048, int_between(1, MAX_SIDE), "largest width or height of a request", metavar="PX")
    max_pixels: int = _field(
        1920 * 1088, int_between(1, MAX_SIDE * MAX_SIDE), "largest width x height of a request", metavar="P"
    )
    max_frames: int = _field(257, int_between(1, MAX_FRAMES), "most frames of a video request", metavar="F")
    max_output_pixels: Optional[int] = _field(
        None,
        optional(int_between(1, 10**12)),
        "largest width x height x frames x n of one request (default: 16 x the "
        "model's default output, at most 1280x720x81 = 74649600; the tiny "
        "model: 2359296)",
        metavar="P",
    )
    max_steps: int = _field(100, int_between(1, MAX_STEPS), "most denoising steps of a request", metavar="N")
    max_n: int = _field(10, int_between(1, 128), "most images per image request", metavar="N")
    max_fps: int = _field(120, int_between(1, MAX_FPS), "highest fps of a video request", metavar="FPS")
    max_body_bytes: int = _field(1 << 20, int_between(1024, 1 << 30), "largest request body in bytes", metavar="BYTES")
    max_image_bytes: int = _field(
        10 << 20,
        int_between(1, 1 << 30),
        "largest input_reference image of an image-to-video job, encoded, in bytes",
        metavar="BYTES",
    )
    max_image_pixels: int = _field(
        4096 * 4096, int_between(1, MAX_SIDE * MAX_SIDE), "largest input_reference image in pixels", metavar="P"
    )
    max_json_depth: int = _field(
        32, int_between(2, 1000), "deepest nesting of a JSON body, checked before parsing", metavar="D"
    )
    max_videos_kept: int = _field(
        1000,
        int_between(1, 10**6),
        "finished video jobs kept; beyond it the oldest are forgotten and their files removed (logged)",
        metavar="N",
    )
    batch_window_s: float = _field(
        0.01, float_between(0.0, 60.0), "seconds the scheduler waits for more requests to fill a batch", metavar="S"
    )
    allowed_hosts: tuple = _field(
        (),
        list_of(text, "host names"),
        "without --api-key: Host header names answered "
        "besides localhost, IP addresses, --host and the --public-url host ('*': any)",
        metavar="HOST[,HOST...]",
    )
    allowed_origins: tuple = _field(
        (),
        list_of(web_origin, "origins"),
        "without --api-key: browser Origins (scheme://host"
        "[:port]) accepted besides the server's own and localhost ('*': any)",
        metavar="ORIGIN[,ORIGIN...]",
    )
    header_timeout_s: float = _field(
        10.0,
        float_between(0.0, 3600.0, lo_open=True),
        "seconds a connection may take to send a request's headers before it is closed",
    )
    body_timeout_s: float = _field(
        30.0,
        float_between(0.0, 3600.0, lo_open=True),
        "seconds a request body may stall (no bytes received) before the connection is closed",
    )
    # scale-out (docs/serving.md "Scale-out"): replicas on Ray Serve sharing a job store and an output folder
    replicas: int = _field(
        1,
        int_between(1, 1024),
        "pipeline replicas behind one endpoint on Ray Serve (1: the single-process server)",
        metavar="N",
    )
    replica_process: bool = _field(
        True,
        boolean,
        "Ray Serve replicas: run the pipeline in a child process of each replica, away from Ray's threads in "
        "the replica's own process (false: in the replica's process)",
    )
    ray_address: Optional[str] = _field(
        None,
        optional(nonempty_text),
        "join this Ray cluster (e.g. auto or HOST:6379; None: start a local Ray instance)",
        metavar="ADDR",
    )
    job_store: Optional[str] = _field(
        None,
        optional(job_store_url),
        "video job store: sqlite (in --output-dir) or "
        "postgresql://USER@HOST:PORT/DB, shared by replicas (None: sqlite)",
        metavar="URL",
    )
    job_lease_s: float = _field(
        30.0,
        float_between(1.0, 86400.0),
        "shared job store: seconds a replica's claim on "
        "a video job lasts without a heartbeat before another replica takes it over",
        metavar="S",
    )
    job_max_attempts: int = _field(
        3,
        int_between(1, 100),
        "shared job store: times a video job is started before it fails with the reason",
        metavar="N",
    )


@dataclasses.dataclass(frozen=True)
class SimulationConfig(_Section):
    """``plan`` / ``backends``: resolve as if on another machine (nothing runs on it).

    platform: ``NAME[:SM]`` (``cuda:90``, ``cuda:120``, ``rocm``, ``xpu``, ``musa``, ``npu``, ``mps``,
    ``cpu``; None: the machine here); platform_packages: the optional packages it has, by import
    name, optionally pinned (``sageattention==2.2.0``; needs ``platform``)."""

    platform: Optional[str] = _field(
        None,
        optional(platform_spec),
        "resolve as if on this platform instead of the machine here: cuda:80, cuda:90, "
        "cuda:100, cuda:120 (any SM), rocm, xpu, musa, npu, mps, cpu; nothing runs on "
        "it",
        metavar="NAME[:SM]",
    )
    platform_packages: Optional[tuple] = _field(
        None,
        optional(package_list),
        "optional packages the simulated platform has (default none), by "
        "import name, optionally pinned: "
        "flash_attn.cute,triton,sageattention==2.2.0",
        metavar="A,B",
    )

    def __post_init__(self):
        super().__post_init__()
        if self.platform is None and self.platform_packages:
            raise AttentionConfigError("--platform-packages needs --platform NAME[:SM]")

    def simulated(self):
        """The simulated :class:`~ditattn.platforms.Platform`, or None (the machine here)."""
        from ditattn.platforms import Platform

        return None if self.platform is None else Platform.from_spec(self.platform, self.platform_packages)

    def scope(self):
        """A context in which :func:`~ditattn.platforms.current_platform` is the simulated platform
        (a no-op context without one)."""
        import contextlib

        from ditattn.platforms import use_platform

        sim = self.simulated()
        return use_platform(sim) if sim is not None else contextlib.nullcontext()


@dataclasses.dataclass(frozen=True)
class BackendsOptions(_Section):
    """``backends``: one line per backend, or one backend in full."""

    backend_name: Optional[str] = _field(
        None,
        optional(text),
        "show this backend in full: its parameters and every reason it does or "
        "does not run here (default: one line per backend; --verbose: all in full)",
        metavar="NAME",
    )


@dataclasses.dataclass(frozen=True)
class CompareOptions(_Section):
    """``compare``: every prompt runs with every seed under every variant (the first is the reference).

    The keys are ``prompts`` / ``seeds`` / ``variant`` (flags ``--prompt P``, ``--seed S [S ...]``,
    ``--variant NAME=SPEC``, each repeatable); variants are parsed by
    :func:`ditattn.evaluation.compare.parse_variant`."""

    prompts: tuple = _field((), text_items, "prompts (each runs with every seed)")
    seeds: tuple = _field((0,), list_of(nonneg_int, "integers >= 0"), "seeds")
    variant: tuple = _field((), text_items, "attention settings NAME=SPEC; the first is the reference")
    capture_steps: tuple = _field(
        (0, -1),
        list_of(integer, "integers"),
        "denoising steps whose attention outputs are compared (negative: from the end)",
    )
    capture_rows: int = _field(4096, nonneg_int, "sequence rows kept per captured output (0: all)")
    in_context: bool = _field(True, boolean, "also run the reference backend on each layer's own inputs")
    warmup: int = _field(1, nonneg_int, "untimed generations per variant first")
    write_video: bool = _field(True, boolean, "write side-by-side MP4s")
    save_clips: bool = _field(False, boolean, "write every clip losslessly to clips.npz (for judging them afterwards)")


@dataclasses.dataclass(frozen=True)
class CalibrateOptions(_Section):
    """``calibrate-cache``: the uncached runs whose per-step signals calibrate the step-cache methods
    (flags ``--prompt P`` repeated, ``--seed S [S ...]``, ``--output FILE.json``)."""

    calibrate_prompts: tuple = _field(
        (),
        text_items,
        "a calibration prompt, repeat for several (each runs with every seed); use prompts you will not judge "
        "the cache on",
        metavar="TEXT",
    )
    calibrate_seeds: tuple = _field((0,), list_of(nonneg_int, "integers >= 0"), "calibration seeds", metavar="S")
    calibrate_output: Optional[str] = _field(
        None,
        optional(nonempty_text),
        "where the calibration JSON is written (a path ending in .json); the methods take it as calibration=PATH",
        metavar="FILE.json",
    )
