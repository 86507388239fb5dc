"""Encoding the server's outputs: PNG images and H.264 MP4 videos, written all or nothing and checked
(:func:`ditattn.pipelines.output.write_mp4`, :func:`ditattn.files.atomic_write`)."""

from __future__ import annotations

import io

import numpy as np

from ditattn.files import atomic_write  # noqa: F401 (re-export: the server's file writes)
from ditattn.pipelines.output import OutputCheckError, WriteStopped  # noqa: F401 (re-export)


def encode_png(frame: np.ndarray) -> bytes:
    """uint8 ``[H, W, 3]`` → PNG bytes."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(frame)).save(buf, format="PNG")
    return buf.getvalue()


def write_mp4(path: str, frames: np.ndarray, fps: int, should_stop=None) -> None:
    """Encode uint8 ``[F, H, W, 3]`` frames as H.264 MP4 at ``fps`` to ``path``: a temporary file
    checked to hold every frame, flushed, then renamed (OSError on a full disk or a bad encode,
    :class:`WriteStopped` once ``should_stop()`` is true; ``path`` untouched either way)."""
    from ditattn.pipelines.output import write_mp4 as _write

    _write(path, frames, fps, macro_block_size=1, should_stop=should_stop)


def failure_reason(exc: BaseException) -> str:
    """What a failed output write says to the client (no path): the disk's or encoder's reason."""
    import errno

    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "the output could not be written: no space left on the server's disk"
    if isinstance(exc, OutputCheckError):
        return f"the output could not be written: {exc.strerror}"
    if isinstance(exc, OSError):
        return f"the output could not be written: {exc.strerror or type(exc).__name__}"
    return f"the output could not be encoded ({type(exc).__name__})"
