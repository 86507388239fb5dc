"""A replica of a scaled-out server: several processes (Ray Serve replicas, or plain ``ditattn
serve`` processes behind any load balancer) share one PostgreSQL job store and one output folder.

:class:`ClusterState` is the :class:`~ditattn.server.state.ServerState` of such a replica:

* image requests run on the replica that received them, as on a single server;
* ``POST /v1/videos`` stores the job as queued (no owner) and returns; every replica's heartbeat
  thread claims queued jobs when it has no video job of its own (one job per replica at a time, so
  jobs go to free replicas), renews the lease of the job it runs, and hands its jobs back when it
  stops.  A job whose replica died is claimed again once its lease runs out, or fails with the
  reason after ``--job-max-attempts`` claims (:mod:`ditattn.server.pgstore`);
* ``GET /v1/videos...`` read the shared store, so a job is pollable and downloadable from any
  replica; ``DELETE`` removes it there and the replica that runs it stops it at its next step;
* a job is marked completed only when its MP4 is complete in the shared folder
  (:class:`~ditattn.server.storage.SharedFolder`), else it fails with ``file_missing``.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Optional

from ditattn.server.jobstores import check_shared, open_job_store
from ditattn.server.protocol import RequestError
from ditattn.server.state import ServerState, job_work
from ditattn.server.storage import SharedFolder
from ditattn.server.store import FINISHED, ImageStore, VideoRecord, VideoStore, remove_file

log = logging.getLogger("ditattn.server")
LEASE_LOST = "lease_lost"


class SharedVideoStore(VideoStore):
    """Video records in the shared store; the ones this replica runs are also kept in memory (their
    scheduler job, fresh progress) until they finish."""

    def __init__(self, max_kept: int, jobs, folder: str, storage: SharedFolder):
        super().__init__(max_kept, jobs, folder)
        self.storage = storage

    def add(self, rec: VideoRecord) -> None:
        """A new job: stored as queued with no owner (a replica with room claims it)."""
        self.jobs.save(rec.to_json(self.folder))

    def adopt(self, rec: VideoRecord) -> None:
        """A job this replica claimed: kept in memory while it runs here."""
        with self._lock:
            self._records[rec.id] = rec

    def local(self) -> list:
        """The unfinished jobs this replica holds."""
        with self._lock:
            return [r for r in self._records.values() if r.status not in FINISHED]

    def drop_local(self, vid: str) -> Optional[VideoRecord]:
        with self._lock:
            return self._records.pop(vid, None)

    def get(self, vid: str) -> Optional[VideoRecord]:
        """The stored record (the shared store is the truth); the scheduler job and the fresher
        progress of a job running here come from memory."""
        data = self.jobs.get(vid)
        return None if data is None else self._merged(data)

    def _merged(self, data: dict) -> VideoRecord:
        rec = VideoRecord.from_json(data, self.folder)
        with self._lock:
            mine = self._records.get(rec.id)
        if mine is not None:
            rec.job = mine.job
            if rec.status not in FINISHED:
                rec.progress = max(rec.progress, mine.progress)
        return rec

    def list(self) -> list:
        out = []
        for data in self.jobs.load():
            try:
                out.append(self._merged(data))
            except (TypeError, KeyError, ValueError):
                log.error("job store: record %s is unreadable", data.get("id"))
        return out

    def pop(self, vid: str) -> Optional[VideoRecord]:
        rec = self.get(vid)
        self.drop_local(vid)
        if rec is not None:
            self.jobs.delete(vid)
        return rec

    def update(self, vid: str, **kw) -> Optional[VideoRecord]:
        """Set fields of a job this replica runs and write status changes through (only while it
        holds the job).  None when the job is not held here or was deleted meanwhile."""
        with self._lock:
            r = self._records.get(vid)
            if r is None:
                return None
            for k, v in kw.items():
                setattr(r, k, v)
            if not any(k in ("status", "path", "error", "completed_at") for k in kw):
                return r
            if r.status == "completed" and not self.storage.is_complete(r.path):
                log.error(
                    "video %s: its output %s is missing or incomplete in the shared folder; marked failed", vid, r.path
                )
                r.status, r.path = "failed", None
                r.error = {"code": "file_missing", "message": "the output file is missing or incomplete"}
            try:
                outcome = self.jobs.update(r.to_json(self.folder))
            except Exception:
                log.exception("job store: cannot save video %s (%s)", vid, r.status)
                return r
            if r.status in FINISHED:
                self._records.pop(vid, None)
        if outcome == "gone":
            log.info("video %s was deleted while it ran here", vid)
            return None
        if outcome == "taken":
            log.warning(
                "video %s: another replica took it over (this replica's lease ran out); its %s result "
                "here is not recorded",
                vid,
                r.status,
            )
        elif r.status in FINISHED:
            self._trim()
        return r

    def _trim(self) -> None:
        for data in self.jobs.finished_beyond(self.max_kept):
            path = data.get("path")
            remove_file(
                os.path.join(self.folder, path) if path else None,
                f"video {data['id']} forgotten: more than {self.max_kept} finished video jobs are kept "
                "(--max-videos-kept)",
            )


class SharedImageStore(ImageStore):
    """Images in the shared folder, found by any replica (the backends that made one are kept next to
    it, ``ID.json``)."""

    def add(self, png: bytes, backends: list) -> str:
        iid = super().add(png, backends)
        try:
            with open(os.path.join(self.folder, iid + ".json"), "w") as f:
                json.dump(backends, f)
        except OSError as exc:
            log.warning("image %s: cannot write its backends file: %s", iid, exc.strerror or exc)
        return iid

    def get(self, iid: str):
        entry = super().get(iid)
        if entry is not None:
            return entry
        path = os.path.join(self.folder, iid + ".png")
        if not os.path.exists(path):
            return None
        try:
            with open(os.path.join(self.folder, iid + ".json")) as f:
                backends = json.load(f)
        except (OSError, ValueError):
            backends = []
        return path, backends if isinstance(backends, list) else []


class ClusterState(ServerState):
    """The state of one replica sharing ``config.job_store`` (PostgreSQL) and ``config.output_dir``
    with the others; ``replicas``: how many there are (the deployment-wide video queue bound is
    ``replicas × max_queue``); ``owner``: this replica's lease-holder id (default: host, pid and a
    random suffix).  AttentionConfigError without a PostgreSQL store or an output folder."""

    def __init__(self, runner, config, *, replicas: Optional[int] = None, owner: Optional[str] = None):
        check_shared(config, "a replica needs")
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.replicas = replicas or config.replicas
        super().__init__(runner, config)
        self.storage = SharedFolder(self.output_dir)
        self.videos = SharedVideoStore(config.max_videos_kept, self.videos.jobs, self.output_dir, self.storage)
        self.images = SharedImageStore(os.path.join(self.output_dir, "images"), config.max_videos_kept * 4)
        self.lease_s = config.job_lease_s
        self.beat_s = max(0.05, min(1.0, self.lease_s / 4))
        self._stop_beat = threading.Event()
        self._wake = threading.Event()
        self._beat: Optional[threading.Thread] = None

    def open_job_store(self):
        return open_job_store(self.config.job_store, self.output_dir, owner=self.owner)

    def restore_jobs(self) -> None:
        """Nothing to reload at start: the jobs stay in the shared store, and this replica's
        heartbeat claims queued ones and ones whose replica died."""
        log.info(
            "replica %s: video jobs from the shared store %s, outputs in %s",
            self.owner,
            self.videos.jobs.path,
            self.output_dir,
        )

    def start(self) -> None:
        super().start()
        self._beat = threading.Thread(target=self._beat_loop, name="ditattn-lease", daemon=True)
        self._beat.start()

    def stop(self) -> None:
        """Stop claiming, stop the running job at its next step (it goes back to the queue for
        another replica: the job store's close hands it back), then the single-server shutdown."""
        self._stop_beat.set()
        self._wake.set()
        if self._beat is not None:
            self._beat.join(10)
        super().stop()

    def pipeline_lost(self) -> Optional[str]:
        """Why this replica's pipeline cannot run any more (its pipeline process ended), else None."""
        why = getattr(self.runner, "exit_reason", None)
        return why() if why is not None else None

    def hand_over(self, rec, exc: BaseException) -> bool:
        """A video job whose pipeline process died under it is not failed here: this replica stops renewing its
        lease (and claims no more), so another replica takes it over once the lease runs out (a job started
        ``--job-max-attempts`` times fails with the reason), while Ray Serve's health check restarts this one."""
        from ditattn.server.pipehost import PipelineProcessDied

        if not isinstance(exc, PipelineProcessDied):
            return False
        self.videos.drop_local(rec.id)
        log.error(
            "replica %s: %s; video %s is left to another replica once its lease runs out", self.owner, exc, rec.id
        )
        return True

    # -- video submission: into the shared queue ------------------------------------------------
    def submit(self, job, *, restore: bool = False) -> concurrent.futures.Future:
        """Image jobs and claimed video jobs (``restore``) run here.  A new video job is already in
        the shared store as queued: a 429 when the deployment's queue (``replicas × max_queue``) is
        full, else a wake-up for the heartbeat; the returned future never completes here (the
        replica that claims the job finishes it)."""
        if job.kind != "video" or restore:
            return super().submit(job, restore=restore)
        self.check_accepting()
        waiting, limit = self.videos.jobs.waiting(), self.replicas * self.config.max_queue
        if waiting > limit:
            self.metrics.queue_full.inc()
            wait = self.retry_after()
            if self._seconds_per_work:  # the shared queue is not in this replica's scheduler: its jobs, this size
                ahead = (waiting - 1) / max(1, self.replicas) * job_work(job) * self._seconds_per_work
                wait = int(min(600, max(wait, round(ahead))))
            log.warning(
                "video job refused (429): %d jobs queued for %d replica(s) (--max-queue %d each); Retry-After %d s",
                waiting - 1,
                self.replicas,
                self.config.max_queue,
                wait,
            )
            raise RequestError(
                f"the video queue is full ({limit} jobs for {self.replicas} replica(s)); retry later",
                status=429,
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(wait)},
                logged=True,
            )
        self._wake.set()
        return concurrent.futures.Future()

    # -- metrics of the whole deployment -------------------------------------------------------
    def publish_metrics(self) -> None:
        """Store this replica's metrics in the shared store (each heartbeat and each scrape)."""
        self.videos.jobs.publish_metrics(self.metrics.render().decode("utf-8"))

    def render_metrics(self) -> bytes:
        """``GET /metrics`` of any replica: every live replica's metrics (published within the lease
        time) with a ``replica`` label, this one's fresh (:func:`~ditattn.server.metrics.deployment_view`).
        This replica's own metrics alone when the shared store cannot be read."""
        from ditattn.server.metrics import deployment_view

        own = self.metrics.render()
        try:
            self.publish_metrics()
            texts = self.videos.jobs.replica_metrics(max(self.lease_s, 3 * self.beat_s))
        except Exception:
            log.exception("replica %s: cannot read the other replicas' metrics; /metrics shows this one's", self.owner)
            texts = {}
        texts[self.owner] = own
        return deployment_view(texts)

    # -- the heartbeat: leases and claims --------------------------------------------------------
    def _beat_loop(self) -> None:
        while not self._stop_beat.is_set():
            try:
                self.beat()
            except Exception:  # the store is unreachable for now: retried at the next beat
                log.exception("replica %s: job store heartbeat failed", self.owner)
            self._wake.wait(self.beat_s)
            self._wake.clear()

    def beat(self) -> Optional[str]:
        """One heartbeat: renew the leases of this replica's jobs (a job deleted or taken over
        meanwhile is stopped here), then claim a queued job if this replica has none.  Returns the
        id of the job it claimed (None otherwise)."""
        from ditattn.server.routes.videos import _requeue

        store = self.videos.jobs
        try:
            self.publish_metrics()
        except Exception:
            log.exception("replica %s: cannot publish its metrics", self.owner)
        if self.pipeline_lost():  # neither renew nor claim: its jobs' leases run out and other replicas take them
            return None
        mine = self.videos.local()
        lost = store.renew([r.id for r in mine], self.lease_s, {r.id: r.progress for r in mine})
        for vid in lost:
            rec = self.videos.drop_local(vid)
            if rec is not None and rec.request:  # its stored first frame is the new holder's (or the deleter's)
                rec.request = {k: v for k, v in rec.request.items() if k != "input_reference_file"}
            if rec is not None and rec.job is not None:
                self.scheduler.cancel(rec.job, LEASE_LOST)
                log.warning(
                    "video %s is no longer held by this replica (deleted, or taken over after its lease ran "
                    "out); stopping it here",
                    vid,
                )
        if self.draining or self._stop_beat.is_set() or len(mine) > len(lost):
            return None
        data, _failed = store.claim(self.lease_s, self.config.job_max_attempts)
        if data is None:
            return None
        try:
            rec = VideoRecord.from_json(data, self.output_dir)
        except (TypeError, KeyError, ValueError) as exc:
            store.update(
                dict(
                    data,
                    status="failed",
                    completed_at=int(time.time()),
                    error={"code": "not_restorable", "message": f"its stored record is unreadable ({exc})"},
                )
            )
            return None
        rec.status, rec.progress = "queued", 0
        self.videos.adopt(rec)
        log.info("replica %s runs video %s", self.owner, rec.id)
        _requeue(self, rec)
        return rec.id
