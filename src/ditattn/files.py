"""Writing files so that a reader (another process, a restart after a crash) never sees a partial one."""

from __future__ import annotations

import errno
import os
import uuid
from typing import Union


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
