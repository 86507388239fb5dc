"""Fuzz targets (hypothesis, derandomized) for what reaches the server from outside a request's JSON
fields: input images (headers that claim any size, truncated or mutated files), the ``Host`` /
``Origin`` headers of a server without an API key, the MP4 check of written outputs (truncated and
mutated files), and job-store records read back at a restart.  Each target accepts exactly the
documented outcomes (a result, or the one error type of that surface); ``tests/server/test_fuzz_server.py``
runs them.  ``DITATTN_FUZZ_SCALE=N`` runs N times as many cases."""

from __future__ import annotations

import io
import json
import os
import sqlite3
import struct
import tempfile
import zlib

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SCALE = max(1, int(os.environ.get("DITATTN_FUZZ_SCALE", "1")))
SETTINGS = dict(
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
COUNTS: dict = {}
MAX_PIXELS = 300 * 300


def _count(name: str) -> None:
    COUNTS[name] = COUNTS.get(name, 0) + 1


# ------------------------------------------------------------------------------------------------
# input images


def _png(w: int, h: int, body: bytes = b"\x00" * 16) -> bytes:
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(body))
        + chunk(b"IEND", b"")
    )


def _bmp(w: int, h: int) -> bytes:
    header = struct.pack("<IiiHHIIiiII", 40, w, h, 1, 24, 0, 0, 2835, 2835, 0, 0)
    return b"BM" + struct.pack("<IHHI", 14 + 40 + 16, 0, 0, 54) + header + b"\x00" * 16


def _real(fmt: str, w: int, h: int) -> bytes:
    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray((np.arange(w * h * 3) % 251).astype(np.uint8).reshape(h, w, 3)).save(buf, format=fmt)
    return buf.getvalue()


def _flip(data: bytes, pos: int, byte: int) -> bytes:
    """``data`` with the byte at ``pos`` (modulo its length) replaced by ``byte``."""
    p = pos % max(1, len(data))
    return data[:p] + bytes([byte]) + data[p + 1 :]


SIDES = st.one_of(st.integers(0, 70000), st.sampled_from([0, 1, 15, 16, 2**15, 2**16, 2**31 - 1, 2**32 - 1]))
IMAGES = st.one_of(
    st.builds(_png, SIDES, SIDES),
    st.builds(_bmp, st.integers(-(2**31), 2**31 - 1), st.integers(-(2**31), 2**31 - 1)),
    st.builds(
        lambda fmt, w, h, cut: _real(fmt, w, h)[:cut],
        st.sampled_from(["PNG", "JPEG", "WEBP", "BMP", "GIF", "TIFF"]),
        st.integers(1, 64),
        st.integers(1, 64),
        st.integers(0, 4000),
    ),
    st.builds(
        lambda fmt, pos, byte: _flip(_real(fmt, 24, 20), pos, byte),
        st.sampled_from(["PNG", "JPEG", "WEBP", "BMP"]),
        st.integers(0, 10**6),
        st.integers(0, 255),
    ),
    st.binary(max_size=200),
)


@settings(max_examples=150 * SCALE, **SETTINGS)
@given(data=IMAGES)
def fuzz_input_images(data):
    """``decode_image_bytes``: an RGB image within the limit, or ImageInputError — never a decode of a
    header that claims too many pixels (Pillow's bomb error included)."""
    from ditattn.pipelines.conditioning import ImageInputError, decode_image_bytes

    _count("images")
    try:
        img = decode_image_bytes(data, max_pixels=MAX_PIXELS)
    except ImageInputError as exc:
        assert str(exc) and len(str(exc)) < 1000
        return
    assert img.mode == "RGB" and img.width * img.height <= MAX_PIXELS


# ------------------------------------------------------------------------------------------------
# Host / Origin of a server without an API key

HEADER_TEXT = st.one_of(
    st.text(max_size=60),
    st.sampled_from(
        [
            "localhost",
            "localhost:1",
            "127.0.0.1:30000",
            "[::1]:8",
            "[::1",
            "::1",
            "evil.example",
            "evil.example:30000",
            "a.localhost",
            "localhost.evil.example",
            "127.0.0.1.nip.io",
            "0.0.0.0",
            "null",
            "*",
            "http://localhost:3000",
            "https://evil.example",
            "http://127.0.0.1",
            "http://[::1]:9",
            "file://",
            "http://",
            "http://[zz]",
            "http://localhost:99999",
            "",
            " ",
            "10.0.0.5",
            "2130706433",
            "LOCALHOST",
            "http://LOCALHOST",
        ]
    ),
)


@settings(max_examples=200 * SCALE, **SETTINGS)
@given(
    host=st.one_of(st.none(), HEADER_TEXT),
    origin=st.one_of(st.none(), HEADER_TEXT),
    allowed_hosts=st.lists(st.sampled_from(["app.example", "*", "[::1]"]), max_size=2),
    allowed_origins=st.lists(st.sampled_from(["https://app.example", "*"]), max_size=2),
    public_url=st.sampled_from([None, "https://img.example.com/x"]),
)
def fuzz_host_origin(host, origin, allowed_hosts, allowed_origins, public_url):
    """``origin_refusal``: None or a 403, never an exception; a foreign name is never let through."""
    from ditattn.runconfig import ServerConfig
    from ditattn.server.errors import _is_ip, origin_refusal

    _count("host_origin")
    cfg = ServerConfig(
        allowed_hosts=tuple(allowed_hosts), allowed_origins=tuple(allowed_origins), public_url=public_url
    )
    headers = [
        (k.encode(), v.encode("latin-1", "replace")) for k, v in (("host", host), ("origin", origin)) if v is not None
    ]
    scope = {"type": "http", "path": "/v1/images/generations", "headers": headers}
    r = origin_refusal(cfg, scope)
    assert r is None or r.status_code == 403
    name = (host or "").strip().lower().rsplit(":", 1)[0]
    if host is not None and r is None and "*" not in allowed_hosts:
        assert (
            name in ("localhost", "app.example", "img.example.com", "127.0.0.1")
            or name.endswith(".localhost")
            or _is_ip(name)
            or _is_ip(name.strip("[]"))
            or host.strip().lower().startswith("[")
            or ":" in name
        ), host
    if origin == "https://evil.example" and "*" not in allowed_origins:
        assert r is not None


# ------------------------------------------------------------------------------------------------
# the MP4 check of written outputs

_MP4: list = []


def _mp4() -> bytes:
    if not _MP4:
        import numpy as np

        from ditattn.pipelines.output import save_frames

        with tempfile.TemporaryDirectory() as d:
            path = save_frames(
                (np.arange(5 * 16 * 16 * 3) % 251).astype(np.uint8).reshape(5, 16, 16, 3), os.path.join(d, "a.mp4")
            )
            with open(path, "rb") as f:
                _MP4.append(f.read())
    return _MP4[0]


@settings(max_examples=150 * SCALE, **SETTINGS)
@given(
    cut=st.integers(0, 100000),
    pos=st.integers(0, 100000),
    byte=st.integers(0, 255),
    how=st.sampled_from(["cut", "flip", "both", "prefix"]),
)
def fuzz_mp4_check(cut, pos, byte, how):
    """``mp4_video_frames`` on truncated / mutated MP4s: a frame count, or OutputCheckError."""
    from ditattn.pipelines.output import OutputCheckError, mp4_video_frames

    _count("mp4")
    data = _mp4()
    if how in ("flip", "both"):
        p = pos % len(data)
        data = data[:p] + bytes([byte]) + data[p + 1 :]
    if how in ("cut", "both"):
        data = data[: cut % (len(data) + 1)]
    if how == "prefix":
        data = bytes([byte]) * (pos % 64) + data
    fd, path = tempfile.mkstemp(suffix=".mp4")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        try:
            n = mp4_video_frames(path)
        except OutputCheckError:
            return
        assert isinstance(n, int) and n >= 0
        if how == "cut" and cut % (len(data) + 1) < len(_mp4()):
            raise AssertionError("a truncated MP4 passed the check")
    finally:
        os.unlink(path)


# ------------------------------------------------------------------------------------------------
# job-store records read back at a restart

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=20))
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=8,
)
FIELDS = [
    "model",
    "prompt",
    "size",
    "seconds",
    "num_frames",
    "fps",
    "num_inference_steps",
    "override",
    "skip_softmax",
    "attention_backends",
    "created_at",
    "request",
    "status",
    "progress",
    "completed_at",
    "error",
    "path",
]


def _good(vid: str) -> dict:
    request = dict(
        prompt="p",
        width=32,
        height=16,
        num_frames=5,
        num_inference_steps=2,
        fps=16,
        negative_prompt=None,
        guidance_scale=5.0,
        guidance_scale_2=None,
        lora=None,
        seed=1,
        override=None,
        skip_softmax=None,
    )
    return dict(
        id=vid,
        model="toy",
        prompt="p",
        size="32x16",
        seconds="0.3",
        num_frames=5,
        fps=16,
        num_inference_steps=2,
        override=None,
        skip_softmax=None,
        attention_backends=[],
        created_at=1,
        request=request,
        status="queued",
        progress=0,
    )


@settings(max_examples=60 * SCALE, **SETTINGS)
@given(
    changes=st.lists(
        st.dictionaries(
            st.sampled_from(
                FIELDS + ["request.seed", "request.width", "request.lora", "request.input_reference_file", "id"]
            ),
            VALUES,
            min_size=1,
            max_size=3,
        ),
        min_size=1,
        max_size=3,
    )
)
def fuzz_job_records(changes):
    """A restart over damaged records: the server starts, the good record is queued again, every damaged
    one ends restored or ``failed`` with a reason — no exception leaves ``restore_jobs``."""
    from ditattn.runconfig import ServerConfig
    from ditattn.server.jobstore import JobStore
    from ditattn.server.routes.videos import restore_jobs
    from ditattn.server.runner import BaseRunner, ModelDefaults
    from ditattn.server.state import ServerState

    _count("job_records")
    with tempfile.TemporaryDirectory() as d:
        store = JobStore(d)
        good = "video_" + "f" * 32
        store.save(_good(good))
        store.close()
        db = sqlite3.connect(os.path.join(d, "jobs.sqlite"))  # damaged rows, as a disk or an old bug leaves them
        ids = []
        for i, change in enumerate(changes):
            rec = _good("video_" + f"{i:032x}")
            for key, value in change.items():
                if key.startswith("request."):
                    rec["request"][key[8:]] = value
                else:
                    rec[key] = value
            if not isinstance(rec.get("id"), str):
                rec["id"] = "video_" + f"{i:032x}"
            rec["id"] = rec["id"][:200]
            ids.append(rec["id"])
            db.execute(
                "INSERT OR REPLACE INTO videos (id, status, record) VALUES (?, ?, ?)",
                (rec["id"], str(rec.get("status"))[:40], json.dumps(rec)),
            )
        db.commit()
        db.close()
        runner = BaseRunner(
            "toy", [], defaults=ModelDefaults(width=32, height=16, num_frames=5, num_inference_steps=2)
        )
        state = ServerState(runner, ServerConfig(output_dir=d, batch_window_s=0.0))
        try:
            restore_jobs(state)
            assert state.videos.get(good).status == "queued"
            for vid in ids:
                rec = state.videos.get(vid)
                if rec is not None and rec.status == "failed" and rec.error is not None:
                    assert rec.error.get("message")
                if rec is not None:
                    rec.to_object()  # what GET /v1/videos answers
        finally:
            state.stop()
