"""Writing files so that a reader (another process, a restart after a crash) never sees a partial one."""
from __future__ import annotations

import os
import uuid
from typing import Union


def atomic_write(path: str, data: Union[bytes, str]) -> None:
    """Write ``data`` (``str``: as UTF-8) to ``path`` through a temporary file in the same folder,
    flushed to disk and then renamed over ``path``: readers see the old file or the new one, never
    a partial one.  The folder must exist; on failure the temporary file is removed and the error
    (``OSError``) propagates."""
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
