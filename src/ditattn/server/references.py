"""``input_reference`` of ``POST /v1/videos``: the first frame of an image-to-video job.

Accepted forms (nothing is fetched from the network, no files API):

* a file upload in a ``multipart/form-data`` body (what ``client.videos.create(input_reference=open(...))``
  sends), read by :mod:`ditattn.server.bodies` into ``{"filename", "content_type", "data"}``;
* OpenAI's reference object ``{"image_url": "data:image/png;base64,..."}`` (JSON, or the form fields
  ``input_reference[image_url]``);
* a string: a ``data:`` URL or bare base64 (JSON bodies).

The image must be PNG, JPEG, WebP or BMP, at most ``max_image_bytes`` encoded and ``max_pixels`` decoded,
at least 16 pixels a side; anything else is a 400 naming ``input_reference`` and what is accepted.
"""

from __future__ import annotations

import base64
import binascii
import re

from ditattn.pipelines.conditioning import ImageInputError, decode_image_bytes
from ditattn.server.protocol import RequestError

ACCEPTED = (
    'a file upload (multipart/form-data), {"image_url": "data:image/...;base64,..."} or a base64 '
    "string; PNG, JPEG, WebP or BMP"
)
_DATA_URL = re.compile(
    r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,", re.IGNORECASE
)


def _refuse(msg: str, code: str = "invalid_input_reference", status: int = 400):
    raise RequestError(f"input_reference: {msg}", param="input_reference", code=code, status=status)


def _from_text(text: str) -> bytes:
    text = text.strip()
    if re.match(r"^(https?|ftp|file)://", text, re.IGNORECASE):
        _refuse("remote URLs are not fetched by this server; send " + ACCEPTED)
    m = _DATA_URL.match(text)
    if text.lower().startswith("data:"):
        if m is None or not m.group("b64"):
            _refuse("a data URL must be base64-encoded (data:image/png;base64,...)")
        mime = (m.group("mime") or "").lower()
        if mime and not mime.startswith("image/"):  # a labelled non-image (data:text/plain) is not guessed at
            _refuse(f"a data URL of type {mime} is not an image; accepted: data:image/png|jpeg|webp|bmp;base64,...")
        text = text[m.end() :]
    try:
        return base64.b64decode(re.sub(r"\s+", "", text), validate=True)
    except (binascii.Error, ValueError):
        _refuse("not valid base64; accepted: " + ACCEPTED)


def reference_bytes(value) -> bytes:
    """The encoded image bytes of an ``input_reference`` value (any accepted form)."""
    if isinstance(value, dict):
        if isinstance(value.get("data"), (bytes, bytearray)):  # a multipart upload
            return bytes(value["data"])
        if value.get("file_id"):
            _refuse("file_id references are not supported (this server has no files API); send " + ACCEPTED)
        url = value.get("image_url")
        if isinstance(url, str) and url.strip():
            return _from_text(url)
        _refuse("expected " + ACCEPTED)
    if isinstance(value, str) and value.strip():
        return _from_text(value)
    _refuse("expected " + ACCEPTED)


def reference_image(value, *, max_bytes: int, max_pixels: int):
    """The RGB PIL image of ``input_reference``, checked (encoded size, format, pixel count); 400 otherwise."""
    data = reference_bytes(value)
    if len(data) > max_bytes:
        _refuse(
            f"the image is {len(data)} bytes; at most {max_bytes} accepted (--max-image-bytes)",
            code="input_reference_too_large",
        )
    try:
        return decode_image_bytes(data, where="input_reference", max_pixels=max_pixels)
    except ImageInputError as exc:
        raise RequestError(str(exc), param="input_reference", code="invalid_input_reference") from None
