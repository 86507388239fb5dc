"""Writing generated frames: MP4 (H.264, yuv420p, via imageio-ffmpeg) for clips, PNG for one frame.

Every file is written all or nothing: to a temporary name in the same folder, checked (an MP4 must
hold a video track with every encoded frame), flushed to disk and renamed; a full disk or a failing
encoder raises OSError and leaves no partial file behind."""

from __future__ import annotations

import errno
import io
import os
import re
import struct
import uuid
from typing import Optional

import numpy as np

from ditattn.errors import AttentionConfigError
from ditattn.files import atomic_write

EXTENSIONS = (".mp4", ".png")


def default_file_name(prompt: str, seed: int, num_frames: Optional[int]) -> str:
    """``<prompt slug>_s<seed>.mp4`` (or ``.png`` for one frame; None: not known yet, a video)."""
    slug = re.sub(r"\W+", "_", prompt).strip("_")[:48].rstrip("_") or "output"  # letters of any script kept
    return f"{slug}_s{seed}{'.png' if num_frames == 1 else '.mp4'}"


def output_file_path(
    out_dir: str,
    file_name: Optional[str],
    prompt: str,
    seed: int,
    num_frames: Optional[int],
    flag: str = "--output-file",
) -> str:
    """Where to write: ``out_dir/file_name`` (extension added when missing); a ``.png`` name for a
    multi-frame clip, an ``.mp4`` for one frame or another extension is an
    :class:`AttentionConfigError` naming ``flag``, the setting the name came from (``num_frames``
    None: not known yet, the frame checks wait)."""
    if not file_name:
        file_name = default_file_name(prompt, seed, num_frames)
    if os.sep in file_name or (os.altsep and os.altsep in file_name):
        raise AttentionConfigError(f"{flag} '{file_name}' must be a file name; put the folder in --output-path")
    stem, ext = os.path.splitext(file_name)
    ext = ext.lower()
    if not ext:
        file_name = f"{file_name}{'.png' if num_frames == 1 else '.mp4'}"
    elif ext not in EXTENSIONS:
        raise AttentionConfigError(f"{flag} '{file_name}': unsupported extension '{ext}'; accepted: .mp4, .png")
    elif ext == ".png" and num_frames not in (1, None):
        raise AttentionConfigError(
            f"{flag} '{file_name}': a {num_frames}-frame video cannot be a .png; use .mp4 or --num-frames 1"
        )
    elif ext == ".mp4" and num_frames == 1:
        raise AttentionConfigError(
            f"{flag} '{file_name}': one frame is written as a .png image, not an .mp4; use "
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
        raise AttentionConfigError(
            f"--output-path '{output_path}': unsupported extension '{ext}'; accepted: .mp4 "
            "(clips), .png (one frame), or a folder"
        )
    if os.path.splitext(output_path)[1].lower() in EXTENSIONS:
        if output_file:
            raise AttentionConfigError(
                f"--output-path '{output_path}' names a file and --output-file '{output_file}' another; give either "
                "--output-path FILE.mp4 or --output-path DIR --output-file NAME"
            )
        folder, name = os.path.split(output_path)
        return folder or ".", name
    return output_path, output_file


def check_output_target(path: str, *, flag: str = "--output-path", writer: bool = True) -> None:
    """Before any work: ``path``'s folder exists or can be created and is writable, ``path`` is not
    a folder, and (``writer``) the writer of its kind is installed (imageio-ffmpeg's ffmpeg for ``.mp4``,
    Pillow for ``.png``).  Raises :class:`AttentionConfigError` with what to change (naming ``flag``)."""
    if os.path.isdir(path):
        raise AttentionConfigError(f"the output file {path} is an existing folder; choose another name")
    check_output_folder(os.path.dirname(os.path.abspath(path)), flag=flag, what=path)
    if writer:
        _check_writer(path)


def check_output_folder(folder: str, *, flag: str = "--output-path", what: Optional[str] = None) -> None:
    """Before any work: ``folder`` is a folder that exists or can be created, and takes new files
    (permission bits, read-only and pseudo file systems such as /proc and /sys).  Raises
    :class:`AttentionConfigError` naming ``flag``; ``what``: the file to be written there, for the message."""
    from ditattn.files import folder_problem

    why = folder_problem(folder)
    if why is not None:
        raise AttentionConfigError(f"cannot write {what or os.path.abspath(folder)}: {why}; choose another {flag}")


def _check_writer(path: str) -> None:
    """The writer of ``path``'s kind is installed (imageio-ffmpeg's ffmpeg for ``.mp4``, else Pillow)."""
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
            raise AttentionConfigError(
                "cannot write PNG images: Pillow is not installed (pip install pillow)"
            ) from None


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


class OutputCheckError(OSError):
    """A written output file that is not what was encoded (empty, truncated, no video stream, wrong
    frame count); ``strerror`` says what (no path)."""

    def __init__(self, what: str):
        super().__init__(errno.EIO, what)


class WriteStopped(Exception):
    """An encode stopped between frames because its ``should_stop`` asked (nothing was written)."""


def _boxes(data: bytes, start: int, end: int):
    """``(type, payload_start, box_end)`` of the ISO-BMFF boxes in ``data[start:end]``; raises
    :class:`OutputCheckError` when a box runs past ``end`` (a truncated file)."""
    pos = start
    while pos < end:
        if end - pos < 8:
            raise OutputCheckError(f"the MP4 is truncated ({end - pos} stray bytes after the last box)")
        size, kind = struct.unpack(">I4s", data[pos : pos + 8])
        head = 8
        if size == 1:
            if end - pos < 16:
                raise OutputCheckError("the MP4 is truncated (in a box header)")
            size, head = struct.unpack(">Q", data[pos + 8 : pos + 16])[0], 16
        elif size == 0:
            size = end - pos
        if size < head or pos + size > end:
            name = kind.decode("latin-1")
            raise OutputCheckError(f"the MP4 is truncated (box '{name}' runs past the end of the file)")
        yield kind, pos + head, pos + size
        pos += size


def mp4_video_frames(path: str) -> int:
    """The sample (frame) count of the first video track of the MP4 at ``path``, read from its
    ``moov`` box (nothing is decoded); :class:`OutputCheckError` when the file is empty, truncated,
    has no ``moov`` or no video track."""
    with open(path, "rb") as f:
        data = f.read()
    if not data:
        raise OutputCheckError("the MP4 is empty")
    top = {kind: (a, b) for kind, a, b in _boxes(data, 0, len(data))}
    if b"moov" not in top:
        raise OutputCheckError("the MP4 has no 'moov' box (the encoder did not finish it)")
    if b"mdat" not in top:
        raise OutputCheckError("the MP4 has no 'mdat' box (no encoded frames)")
    for kind, a, b in _boxes(data, *top[b"moov"]):
        if kind != b"trak":
            continue
        mdia = {k: (x, y) for k, x, y in _boxes(data, a, b)}.get(b"mdia")
        if mdia is None:
            continue
        parts = {k: (x, y) for k, x, y in _boxes(data, *mdia)}
        hdlr, minf = parts.get(b"hdlr"), parts.get(b"minf")
        if hdlr is None or minf is None or data[hdlr[0] + 8 : hdlr[0] + 12] != b"vide":
            continue
        stbl = {k: (x, y) for k, x, y in _boxes(data, *minf)}.get(b"stbl")
        stsz = {k: (x, y) for k, x, y in _boxes(data, *stbl)}.get(b"stsz") if stbl else None
        if stsz is None or stsz[1] - stsz[0] < 12:
            raise OutputCheckError("the MP4's video track has no sample table")
        return struct.unpack(">I", data[stsz[0] + 8 : stsz[0] + 12])[0]
    raise OutputCheckError("the MP4 has no video stream")


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover - not POSIX
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some file systems refuse a folder fsync
        pass
    finally:
        os.close(fd)


def _publish(tmp: str, path: str) -> None:
    """Flush ``tmp`` to disk, rename it over ``path`` and flush the folder entry."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_mp4(
    path: str,
    frames: np.ndarray,
    fps: int,
    *,
    quality: Optional[float] = None,
    macro_block_size: int = 16,
    should_stop=None,
) -> str:
    """Encode uint8 ``[F, H, W, 3]`` frames as H.264 (yuv420p) MP4 at ``fps`` to ``path``,
    all or nothing: written to a hidden temporary file in the same folder, checked (a video track
    holding ``F`` frames: :func:`mp4_video_frames`), flushed to disk, then renamed over ``path``.

    Raises OSError (the encoder's or the disk's error, e.g. ENOSPC; :class:`OutputCheckError` for a
    file that does not hold the frames) and :class:`WriteStopped` when ``should_stop()`` (asked
    before each frame) returns true; in every failure ``path`` is untouched and the temporary file
    removed.  Returns ``path``."""
    import imageio.v2 as imageio

    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{uuid.uuid4().hex}.tmp.mp4")
    kw = {} if quality is None else {"quality": quality}
    try:
        writer = imageio.get_writer(
            tmp,
            format="FFMPEG",
            mode="I",
            fps=fps,
            codec="libx264",
            pixelformat="yuv420p",
            macro_block_size=macro_block_size,
            ffmpeg_log_level="error",
            **kw,
        )
        try:
            for fr in frames:
                if should_stop is not None and should_stop():
                    raise WriteStopped()
                writer.append_data(np.ascontiguousarray(fr))
        finally:
            writer.close()
        got = mp4_video_frames(tmp)
        if got != len(frames):
            raise OutputCheckError(f"the MP4 holds {got} frame(s), {len(frames)} were encoded")
        _publish(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def write_png(path: str, frame: np.ndarray) -> str:
    """Write uint8 ``[H, W, 3]`` ``frame`` as a PNG to ``path`` through a temporary file (checked:
    its full size on disk, flushed, renamed); OSError on failure, ``path`` untouched.  Returns ``path``."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(frame)).save(buf, format="PNG")
    atomic_write(path, buf.getvalue())
    return path


def save_frames(frames: np.ndarray, path: str, fps: int = 16) -> str:
    """Write ``frames`` (uint8 ``[F, H, W, 3]``) to ``path`` (.mp4 or .png) atomically and checked
    (:func:`write_mp4`, :func:`write_png`); returns the path.  OSError when it cannot be written."""
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be uint8 [F, H, W, 3], got {frames.dtype} {frames.shape}")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if path.lower().endswith(".png"):
        return write_png(path, frames[0])
    h, w = frames.shape[1:3]
    block = 16 if h % 16 == 0 and w % 16 == 0 else 2
    if h % block or w % block:  # yuv420p needs even sizes
        frames = np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
    return write_mp4(path, frames, fps, quality=8, macro_block_size=block)


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
            raise AttentionConfigError(
                f"save_video writes one clip; got a batch of {frames.shape[0]} (pass frames[i] for clip i)"
            )
        frames = frames[0]
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise AttentionConfigError(
            f"save_video expects frames [F, H, W, 3] (or [1, F, H, W, 3]), got shape {tuple(frames.shape)}"
        )
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
