"""Where a server's output files live: :class:`OutputStorage` is what the server needs of it (a
path to write a finished file to, whether a file is complete, removal), :class:`SharedFolder` the
implementation over a folder every replica mounts (local disk for one host, NFS / a cluster file
system for several).  An object store can implement the same three methods later."""

from __future__ import annotations

import logging
import os
import struct
from typing import Optional, Protocol

log = logging.getLogger("ditattn.server")

# top-level ISO base media (MP4) boxes; a complete file is a run of these ending exactly at its size
_MP4_TOP = {
    b"ftyp",
    b"moov",
    b"mdat",
    b"free",
    b"skip",
    b"wide",
    b"uuid",
    b"meta",
    b"pdin",
    b"moof",
    b"mfra",
    b"styp",
    b"sidx",
    b"ssix",
    b"prft",
    b"emsg",
}


class OutputStorage(Protocol):
    """The output store the replicas share."""

    def path(self, kind: str, name: str) -> str:
        """Where the output ``name`` of ``kind`` (``videos`` / ``images``) is written and read."""

    def is_complete(self, path: Optional[str]) -> bool:
        """True when ``path`` holds a whole output file (not missing, empty, or cut short)."""

    def remove(self, path: Optional[str]) -> None:
        """Remove ``path`` if it exists."""


class SharedFolder:
    """Outputs under ``root``/``videos`` and ``root``/``images`` (created if missing)."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        for kind in ("videos", "images"):
            os.makedirs(os.path.join(self.root, kind), exist_ok=True)

    def path(self, kind: str, name: str) -> str:
        if kind not in ("videos", "images") or os.sep in name or name.startswith("."):
            raise ValueError(f"output {kind}/{name} is not a server output name")
        return os.path.join(self.root, kind, name)

    def is_complete(self, path: Optional[str]) -> bool:
        if not path or not os.path.isfile(path):
            return False
        try:
            size = os.path.getsize(path)
            if size == 0:
                return False
            if path.endswith(".mp4"):
                return mp4_complete(path, size)
            if path.endswith(".png"):
                with open(path, "rb") as f:
                    f.seek(size - 12)
                    return f.read(12)[4:8] == b"IEND"
        except OSError:
            return False
        return True

    def remove(self, path: Optional[str]) -> None:
        if path and os.path.exists(path):
            try:
                os.unlink(path)
            except OSError as exc:
                log.warning("could not remove %s: %s", path, exc.strerror or exc)


def mp4_complete(path: str, size: int) -> bool:
    """True when the file at ``path`` (``size`` bytes) is a sequence of top-level MP4 boxes that
    ends exactly at its size and includes ``moov`` (a file cut short fails)."""
    seen, pos = set(), 0
    with open(path, "rb") as f:
        while pos < size:
            f.seek(pos)
            head = f.read(16)
            if len(head) < 8:
                return False
            n, kind = struct.unpack(">I4s", head[:8])
            if n == 1:
                if len(head) < 16:
                    return False
                n = struct.unpack(">Q", head[8:16])[0]
            elif n == 0:  # extends to the end of the file
                n = size - pos
            if kind not in _MP4_TOP or n < 8 or pos + n > size:
                return False
            seen.add(kind)
            pos += n
    return b"moov" in seen and b"mdat" in seen
