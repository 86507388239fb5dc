"""What the server keeps between requests: video job records (written through to the on-disk
:class:`~ditattn.server.jobstore.JobStore` when the server has an ``--output-dir``) and stored
images, both bounded.  Every file removed here is logged with its reason."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import uuid
from collections import OrderedDict
from typing import Any, Optional

from ditattn.files import atomic_write
from ditattn.server.protocol import VideoError, VideoObject

log = logging.getLogger("ditattn.server")

FINISHED = ("completed", "failed")
_PERSISTED = ("status", "path", "error", "completed_at", "attention_backends", "skip_softmax", "cache")


@dataclasses.dataclass
class VideoRecord:
    """One video job: the validated request (``request``: the fields that rebuild its scheduler job
    after a restart), its status (queued → in_progress → completed or failed), progress in
    percent, error, output path, and the scheduler job while it is pending."""

    id: str
    model: str
    prompt: str
    size: str
    seconds: str
    num_frames: int
    fps: int
    num_inference_steps: int
    override: Optional[str]
    skip_softmax: Optional[dict]
    attention_backends: list
    created_at: int
    request: dict = dataclasses.field(default_factory=dict)
    status: str = "queued"
    progress: int = 0
    completed_at: Optional[int] = None
    error: Optional[dict] = None
    path: Optional[str] = None
    cache: Optional[dict] = None  # the step cache's report once completed
    job: Any = None

    def to_object(self) -> VideoObject:
        return VideoObject(
            id=self.id,
            created_at=self.created_at,
            completed_at=self.completed_at,
            model=self.model,
            progress=self.progress,
            prompt=self.prompt,
            seconds=self.seconds,
            size=self.size,
            status=self.status,
            error=VideoError(**self.error) if self.error else None,
            attention_backends=list(self.attention_backends),
            attention_backend_override=self.override,
            skip_softmax=self.skip_softmax,
            num_frames=self.num_frames,
            fps=self.fps,
            num_inference_steps=self.num_inference_steps,
            cache=self.cache,
        )

    def to_json(self, folder: str) -> dict:
        """The stored form: every field but the live job; ``path`` relative to ``folder``."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "job"}
        if self.path:
            d["path"] = os.path.relpath(self.path, folder)
        return d

    @classmethod
    def from_json(cls, data: dict, folder: str) -> "VideoRecord":
        """A record read back from the store (``path`` made absolute under ``folder``; unknown keys
        ignored, so a store written by a newer version still loads). Raises TypeError / KeyError
        for a record missing required fields."""
        names = {f.name for f in dataclasses.fields(cls)} - {"job"}
        rec = cls(**{k: v for k, v in data.items() if k in names})
        if rec.path:
            rec.path = os.path.normpath(os.path.join(folder, rec.path))
        return rec


class VideoStore:
    """Video job records by id (insertion order), bounded: beyond ``max_kept`` the oldest finished
    ones are forgotten and their files removed (logged).  ``jobs`` (optional): the on-disk store
    every status change is written to; ``folder``: the output folder paths are stored relative to."""

    def __init__(self, max_kept: int, jobs=None, folder: str = ""):
        self.max_kept = max_kept
        self.jobs = jobs
        self.folder = folder
        self._records: "OrderedDict[str, VideoRecord]" = OrderedDict()
        self._lock = threading.RLock()
        self._unsaved: "OrderedDict[str, tuple]" = OrderedDict()  # id -> (write, what): writes that failed
        self._reported: set = set()
        self.error: Optional[str] = None  # the last job-store write failure, while writes are pending

    def add(self, rec: VideoRecord) -> None:
        drop = []
        with self._lock:
            self._records[rec.id] = rec
            self._persist(rec)
            if len(self._records) > self.max_kept:
                for vid, r in list(self._records.items()):
                    if len(self._records) <= self.max_kept:
                        break
                    if r.status in FINISHED:
                        drop.append(self._records.pop(vid))
                        self._forget(vid)
        for r in drop:
            remove_file(
                r.path,
                f"video {r.id} forgotten: more than {self.max_kept} finished video jobs are kept (--max-videos-kept)",
            )

    def get(self, vid: str) -> Optional[VideoRecord]:
        with self._lock:
            return self._records.get(vid)

    def pop(self, vid: str) -> Optional[VideoRecord]:
        with self._lock:
            rec = self._records.pop(vid, None)
            if rec is not None:
                self._forget(vid)
            return rec

    def list(self) -> list:
        with self._lock:
            return list(self._records.values())

    def update(self, vid: str, **kw) -> Optional[VideoRecord]:
        """Set fields of record ``vid`` (None if it is gone); status, path and error changes are
        written to the job store."""
        with self._lock:
            r = self._records.get(vid)
            if r is not None:
                for k, v in kw.items():
                    setattr(r, k, v)
                if any(k in _PERSISTED for k in kw):
                    self._persist(r)
            return r

    def _persist(self, rec: VideoRecord) -> None:
        self._write(rec.id, lambda: self.jobs.save(rec.to_json(self.folder)), f"save video {rec.id} ({rec.status})")

    def _forget(self, vid: str) -> None:
        self._write(vid, lambda: self.jobs.delete(vid), f"delete video {vid}")

    def _write(self, vid: str, op, what: str) -> None:
        """One job-store write.  A failure (a full disk, a read-only file) is logged as an error and
        kept: the record stays in memory, its write is retried with every later write and every
        ``/health`` (:meth:`retry_unsaved`), and :meth:`problem` reports it until one succeeds.
        Once the store is closed (shutdown) a warning, no retry."""
        if self.jobs is None:
            return
        if self.jobs.closed:
            log.warning("job store closed: cannot %s", what)
            return
        with self._lock:
            self._unsaved.pop(vid, None)
            self._unsaved[vid] = (op, what)
            self._flush()

    def _flush(self) -> None:
        for vid, (op, what) in list(self._unsaved.items()):
            try:
                op()
            except Exception as exc:  # noqa: BLE001 - sqlite3 or OS errors: reported, retried
                reason = store_error_text(exc)
                if self.error != reason or vid not in self._reported:
                    log.error(
                        "job store %s: cannot %s: %s; the job's state is kept in memory and written again "
                        "once the store takes writes (GET /health reports it)",
                        self.jobs.path,
                        what,
                        reason,
                    )
                    self._reported.add(vid)
                self.error = reason
                return  # keep the order: the later ones wait for this one
            self._unsaved.pop(vid, None)
            self._reported.discard(vid)
        if self.error is not None:
            log.warning("job store %s takes writes again; every job's state is saved", self.jobs.path)
            self.error = None

    def retry_unsaved(self) -> None:
        """Try the job-store writes that failed again (called by ``/health``)."""
        if self.jobs is None or self.jobs.closed:
            return
        with self._lock:
            if self._unsaved:
                self._flush()

    def problem(self) -> Optional[str]:
        """Why the job store is behind the jobs served (None when every change is saved)."""
        with self._lock:
            if not self._unsaved:
                return None
            return (
                f"the job store cannot be written ({self.error}); {len(self._unsaved)} video job change(s) not "
                f"saved yet (a restart before it can write again sees their last saved state)"
            )


def store_error_text(exc: BaseException) -> str:
    """A short reason for a failed job-store write: a full disk is called a full disk."""
    import errno

    text = str(exc)
    if (
        isinstance(exc, OSError)
        and exc.errno in (errno.ENOSPC, errno.EDQUOT)
        or "disk is full" in text
        or "database or disk is full" in text
    ):
        return "the disk is full"
    return f"{type(exc).__name__}: {text[:200]}"


def remove_file(path: Optional[str], why: str) -> None:
    """Remove ``path`` if one is given and it exists, logging ``why`` (no file goes silently)."""
    if path and os.path.exists(path):
        try:
            os.unlink(path)
        except OSError as exc:
            log.warning("%s; could not remove %s: %s", why, path, exc.strerror or exc)
        else:
            log.info("%s; removed %s", why, path)


class ImageStore:
    """PNG images served at ``GET /v1/images/{id}/content`` (``response_format="url"``), by id,
    each with the DiT backends that made it; at most ``max_kept`` (the oldest file is removed,
    logged, beyond that).  The index lives in memory: image URLs do not survive a restart."""

    def __init__(self, folder: str, max_kept: int):
        self.folder, self.max_kept = folder, max_kept
        self._images: "OrderedDict[str, tuple[str, list]]" = OrderedDict()  # id -> (path, backends)
        self._lock = threading.Lock()

    def add(self, png: bytes, backends: list) -> str:
        """Store ``png`` under a new server-generated id; return the id."""
        iid = "img_" + uuid.uuid4().hex
        path = os.path.join(self.folder, iid + ".png")
        atomic_write(path, png)
        drop = []
        with self._lock:
            self._images[iid] = (path, backends)
            while len(self._images) > self.max_kept:
                drop.append(self._images.popitem(last=False))
        for old, (p, _) in drop:
            remove_file(p, f"image {old} forgotten: more than {self.max_kept} images are kept")
        return iid

    def get(self, iid: str) -> Optional[tuple[str, list]]:
        """``(path, backends)`` of image ``iid``, or None."""
        with self._lock:
            return self._images.get(iid)

    def clear_folder(self) -> int:
        """Remove the image files a previous run left in the folder (their URLs died with it), one
        log line for all; returns how many."""
        names = []
        with contextlib.suppress(OSError):
            names = sorted(n for n in os.listdir(self.folder) if n.endswith(".png"))
        removed = 0
        for name in names:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.folder, name))
                removed += 1
        if names:
            log.info(
                "removed %d image(s) of a previous run from %s (image URLs do not survive a restart): %s",
                removed,
                self.folder,
                ", ".join(names),
            )
        return removed
