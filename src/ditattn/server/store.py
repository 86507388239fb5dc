"""What the server keeps between requests: video job records and stored images, both bounded
(the oldest finished entries and their files are forgotten first)."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import uuid
from collections import OrderedDict
from typing import Any, Optional

from ditattn.server.media import atomic_write
from ditattn.server.protocol import VideoError, VideoObject


@dataclasses.dataclass
class VideoRecord:
    """One video job: the validated request, its status (queued → in_progress → completed or
    failed), progress in percent, error, output path, and the scheduler job while it is pending."""

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
    status: str = "queued"
    progress: int = 0
    completed_at: Optional[int] = None
    error: Optional[dict] = None
    path: Optional[str] = None
    job: Any = None

    def to_object(self) -> VideoObject:
        return VideoObject(
            id=self.id, created_at=self.created_at, completed_at=self.completed_at, model=self.model,
            progress=self.progress, prompt=self.prompt, seconds=self.seconds, size=self.size, status=self.status,
            error=VideoError(**self.error) if self.error else None, attention_backends=list(self.attention_backends),
            attention_backend_override=self.override, skip_softmax=self.skip_softmax, num_frames=self.num_frames,
            fps=self.fps, num_inference_steps=self.num_inference_steps,
        )


class VideoStore:
    """Video job records by id (insertion order), bounded: the oldest finished ones are forgotten."""

    def __init__(self, max_kept: int):
        self.max_kept = max_kept
        self._records: "OrderedDict[str, VideoRecord]" = OrderedDict()
        self._lock = threading.Lock()

    def add(self, rec: VideoRecord) -> None:
        drop = []
        with self._lock:
            self._records[rec.id] = rec
            if len(self._records) > self.max_kept:
                for vid, r in list(self._records.items()):
                    if len(self._records) <= self.max_kept:
                        break
                    if r.status in ("completed", "failed"):
                        drop.append(self._records.pop(vid))
        for r in drop:
            unlink(r.path)

    def get(self, vid: str) -> Optional[VideoRecord]:
        with self._lock:
            return self._records.get(vid)

    def pop(self, vid: str) -> Optional[VideoRecord]:
        with self._lock:
            return self._records.pop(vid, None)

    def list(self) -> list:
        with self._lock:
            return list(self._records.values())

    def update(self, vid: str, **kw) -> None:
        with self._lock:
            r = self._records.get(vid)
            if r is not None:
                for k, v in kw.items():
                    setattr(r, k, v)


def unlink(path: Optional[str]) -> None:
    """Remove ``path`` if one is given and it still exists."""
    if path:
        with contextlib.suppress(OSError):
            os.unlink(path)


class ImageStore:
    """PNG images served at ``GET /v1/images/{id}/content`` (``response_format="url"``), by id,
    each with the DiT backends that made it; at most ``max_kept``."""

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
                drop.append(self._images.popitem(last=False)[1][0])
        for p in drop:
            unlink(p)
        return iid

    def get(self, iid: str) -> Optional[tuple[str, list]]:
        """``(path, backends)`` of image ``iid``, or None."""
        with self._lock:
            return self._images.get(iid)
