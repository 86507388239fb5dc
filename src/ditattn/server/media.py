"""Encoding the server's outputs: PNG images and H.264 MP4 videos, written atomically
(:func:`ditattn.files.atomic_write`)."""
from __future__ import annotations

import io
import os
import uuid

import numpy as np

from ditattn.files import atomic_write  # noqa: F401 (re-export: the server's file writes)


def encode_png(frame: np.ndarray) -> bytes:
    """uint8 ``[H, W, 3]`` → PNG bytes."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(frame)).save(buf, format="PNG")
    return buf.getvalue()


def write_mp4(path: str, frames: np.ndarray, fps: int) -> None:
    """Encode uint8 ``[F, H, W, 3]`` frames as H.264 MP4 at ``fps``, written atomically to ``path``."""
    import imageio.v2 as imageio

    tmp = os.path.join(os.path.dirname(path), f".{uuid.uuid4().hex}.tmp.mp4")
    try:
        with imageio.get_writer(tmp, format="FFMPEG", fps=fps, codec="libx264", pixelformat="yuv420p",
                                macro_block_size=1, ffmpeg_log_level="error") as w:
            for fr in frames:
                w.append_data(np.ascontiguousarray(fr))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
