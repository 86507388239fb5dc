"""Writing files so that a reader (another process, a restart after a crash) never sees a partial one."""

from __future__ import annotations

import errno
import os
import tempfile
import uuid
from typing import Optional, Union


def atomic_write(path: str, data: Union[bytes, str]) -> None:
    """Write ``data`` (``str``: as UTF-8) to ``path`` through a temporary file in the same folder,
    flushed to disk and then renamed over ``path``: readers see the old file or the new one, never
    a partial one.  The temporary file must hold every byte before it is renamed.  The folder must
    exist; on failure (a full disk: ``ENOSPC``) the temporary file is removed and the error
    (``OSError``) propagates."""
    body = data.encode("utf-8") if isinstance(data, str) else data
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
            size = os.fstat(f.fileno()).st_size
        if size != len(body):
            raise OSError(errno.EIO, f"short write: {size} of {len(body)} bytes reached the disk")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def folder_problem(folder: str) -> Optional[str]:
    """Why files cannot be written into ``folder`` (None: they can): it, or the nearest ancestor that exists
    (which decides whether it can be created), is a file, lacks write permission, or takes no new file
    (what the permission bits do not tell: read-only and pseudo file systems such as /proc and /sys;
    checked by creating and removing an empty file there)."""
    probe = os.path.abspath(folder)  # the walk up to an existing ancestor ends at the root
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        return f"{probe} is a file, not a folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"no write permission in {probe}"
    try:
        fd, probe_file = tempfile.mkstemp(dir=probe, prefix=".ditattn-write-check-")
        os.close(fd)
        os.remove(probe_file)
    except OSError as exc:
        return f"{probe} does not take new files ({exc.strerror or exc})"
    return None
