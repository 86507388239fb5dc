"""Writing generated frames: MP4 (H.264, yuv420p, via imageio-ffmpeg) for clips, PNG for one frame."""
from __future__ import annotations

import os
import re
import tempfile
from typing import Optional

import numpy as np

from ditattn.errors import AttentionConfigError

EXTENSIONS = (".mp4", ".png")


def default_file_name(prompt: str, seed: int, num_frames: Optional[int]) -> str:
    """``<prompt slug>_s<seed>.mp4`` (or ``.png`` for one frame; None: not known yet, a video)."""
    slug = re.sub(r"[^A-Za-z0-9]+", "_", prompt).strip("_")[:48].rstrip("_") or "output"
    return f"{slug}_s{seed}{'.png' if num_frames == 1 else '.mp4'}"


def output_file_path(out_dir: str, file_name: Optional[str], prompt: str, seed: int,
                     num_frames: Optional[int]) -> str:
    """Where to write: ``out_dir/file_name`` (extension added when missing); a ``.png`` name for a
    multi-frame clip, an ``.mp4`` for one frame or another extension is an
    :class:`AttentionConfigError` (``num_frames`` None: not known yet, the frame checks wait)."""
    if not file_name:
        file_name = default_file_name(prompt, seed, num_frames)
    if os.sep in file_name or (os.altsep and os.altsep in file_name):
        raise AttentionConfigError(f"--output-file '{file_name}' must be a file name; put the folder in --output-path")
    stem, ext = os.path.splitext(file_name)
    ext = ext.lower()
    if not ext:
        file_name = f"{file_name}{'.png' if num_frames == 1 else '.mp4'}"
    elif ext not in EXTENSIONS:
        raise AttentionConfigError(f"--output-file '{file_name}': unsupported extension '{ext}'; accepted: .mp4, .png")
    elif ext == ".png" and num_frames not in (1, None):
        raise AttentionConfigError(
            f"--output-file '{file_name}': a {num_frames}-frame video cannot be a .png; use .mp4 or --num-frames 1"
        )
    elif ext == ".mp4" and num_frames == 1:
        raise AttentionConfigError(
            f"--output-file '{file_name}': one frame is written as a .png image, not an .mp4; use "
            f"'{stem}.png' (or no extension), or more frames (--num-frames 5)"
        )
    return os.path.join(out_dir, file_name)


def split_output_target(output_path: str, output_file: Optional[str]) -> tuple[str, Optional[str]]:
    """``(folder, file name)`` of ``--output-path`` / ``--output-file``: an output path ending in
    ``.mp4`` / ``.png`` is the file itself (then ``--output-file`` must be left out); a path with
    another extension (``clip.gif``) is an :class:`AttentionConfigError` unless it is an existing
    folder."""
    ext = os.path.splitext(output_path.rstrip("/\\"))[1].lower()
    if ext and ext not in EXTENSIONS and not os.path.isdir(output_path):
        raise AttentionConfigError(f"--output-path '{output_path}': unsupported extension '{ext}'; accepted: .mp4 "
                                   "(clips), .png (one frame), or a folder")
    if os.path.splitext(output_path)[1].lower() in EXTENSIONS:
        if output_file:
            raise AttentionConfigError(
                f"--output-path '{output_path}' names a file and --output-file '{output_file}' another; give either "
                "--output-path FILE.mp4 or --output-path DIR --output-file NAME"
            )
        folder, name = os.path.split(output_path)
        return folder or ".", name
    return output_path, output_file


def check_output_target(path: str) -> None:
    """Before any work: ``path``'s folder exists or can be created and is writable, ``path`` is not
    a folder, and the writer of its kind is installed (imageio-ffmpeg's ffmpeg for ``.mp4``,
    Pillow for ``.png``).  Raises :class:`AttentionConfigError` with what to change."""
    if os.path.isdir(path):
        raise AttentionConfigError(f"the output file {path} is an existing folder; choose another name")
    folder = os.path.dirname(os.path.abspath(path))
    probe = folder
    while not os.path.exists(probe):  # the nearest existing ancestor decides whether it can be created
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise AttentionConfigError(f"cannot write {path}: {probe} is a file, not a folder; choose another "
                                   "--output-path")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise AttentionConfigError(f"cannot write {path}: no write permission in {probe}; choose another "
                                   "--output-path")
    try:  # what the permission bits do not tell: read-only and pseudo file systems (/proc, /sys)
        fd, probe_file = tempfile.mkstemp(dir=probe, prefix=".ditattn-write-check-")
        os.close(fd)
        os.remove(probe_file)
    except OSError as exc:
        raise AttentionConfigError(f"cannot write {path}: {probe} does not take new files ({exc.strerror or exc}); "
                                   "choose another --output-path") from None
    if path.lower().endswith(".mp4"):
        try:
            import imageio_ffmpeg

            imageio_ffmpeg.get_ffmpeg_exe()
        except (ImportError, RuntimeError) as exc:
            raise AttentionConfigError(
                f"cannot write MP4 video: no ffmpeg for imageio ({' '.join(str(exc).split())[:120]}); install "
                "imageio-ffmpeg (pip install imageio-ffmpeg) or set IMAGEIO_FFMPEG_EXE, or write one frame as a "
                "PNG (--num-frames 1)"
            ) from None
    else:
        try:
            import PIL.Image  # noqa: F401
        except ImportError:
            raise AttentionConfigError("cannot write PNG images: Pillow is not installed (pip install pillow)") from None


def unused_path(path: str, overwrite: bool = False) -> str:
    """``path``, or when a file is already there (and not ``overwrite``) the first free
    ``<stem>_1<ext>``, ``<stem>_2<ext>``, ... beside it."""
    if overwrite or not os.path.exists(path):
        return path
    stem, ext = os.path.splitext(path)
    i = 1
    while os.path.exists(f"{stem}_{i}{ext}"):
        i += 1
    return f"{stem}_{i}{ext}"


def save_frames(frames: np.ndarray, path: str, fps: int = 16) -> str:
    """Write ``frames`` (uint8 ``[F, H, W, 3]``) to ``path`` (.mp4 or .png); returns the path."""
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be uint8 [F, H, W, 3], got {frames.dtype} {frames.shape}")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if path.lower().endswith(".png"):
        from PIL import Image

        Image.fromarray(frames[0]).save(path)
        return path
    import imageio.v2 as imageio

    h, w = frames.shape[1:3]
    block = 16 if h % 16 == 0 and w % 16 == 0 else 2
    if h % block or w % block:  # yuv420p needs even sizes
        frames = np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
    writer = imageio.get_writer(path, format="FFMPEG", mode="I", fps=fps, codec="libx264", quality=8,
                                pixelformat="yuv420p", macro_block_size=block, ffmpeg_log_level="error")
    try:
        for f in frames:
            writer.append_data(f)
    finally:
        writer.close()
    return path


def save_video(frames, path: str, *, fps: int = 16) -> str:
    """Write one generated clip to ``path`` (``.mp4``: H.264; ``.png``: a single frame) and return
    the path.

    frames: what :class:`ditattn.WanPipeline` returns — uint8 ``[F, H, W, 3]``, or a batch
    ``[N, F, H, W, 3]`` with ``N == 1`` — or floats in ``[0, 1]`` of the same shapes (numpy or
    torch).  Raises :class:`AttentionConfigError` for other shapes, a batch of several clips, a
    ``.png`` for several frames or an unsupported extension.
    """
    if hasattr(frames, "detach"):  # a torch tensor
        frames = frames.detach().cpu().numpy()
    frames = np.asarray(frames)
    if frames.ndim == 5:
        if frames.shape[0] != 1:
            raise AttentionConfigError(f"save_video writes one clip; got a batch of {frames.shape[0]} "
                                       "(pass frames[i] for clip i)")
        frames = frames[0]
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise AttentionConfigError(f"save_video expects frames [F, H, W, 3] (or [1, F, H, W, 3]), got shape "
                                   f"{tuple(frames.shape)}")
    if frames.dtype != np.uint8:
        if not np.issubdtype(frames.dtype, np.floating):
            raise AttentionConfigError(f"save_video expects uint8 or float frames in [0, 1], got {frames.dtype}")
        frames = (np.clip(frames, 0.0, 1.0) * 255.0).round().astype(np.uint8)
    if not isinstance(fps, int) or isinstance(fps, bool) or fps < 1:
        raise AttentionConfigError(f"fps must be a positive integer, got {fps!r}")
    folder, file_name = os.path.split(os.fspath(path))
    target = output_file_path(folder or ".", file_name, "", 0, frames.shape[0])
    try:
        return save_frames(frames, target, fps=fps)
    except OSError as exc:
        raise AttentionConfigError(f"cannot write {target}: {exc.strerror or exc}") from None
