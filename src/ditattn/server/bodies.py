"""Request bodies: JSON, ``multipart/form-data`` (as the openai client sends video jobs) and
url-encoded forms, read under a size limit and validated into the protocol models.

Forms go through Starlette's form parsers on ``python-multipart`` (what FastAPI uses for
``Form``/``File`` parameters); an endpoint here takes JSON *or* a form, so the body is read once and
dispatched on its content type.  Uploaded files become the marker ``{"filename": ...}`` (never
stored) except ``input_reference``, whose bytes the image-to-video endpoint decodes
(``{"filename", "content_type", "data"}``); nested form keys (``p[x]``) are unflattened by
:func:`~ditattn.server.protocol.unflatten_form`.
"""

from __future__ import annotations

import json
from urllib.parse import unquote_to_bytes

import python_multipart  # noqa: F401  (the form parsers below need it: fail at import, not per request)
from fastapi import Request
from pydantic import ValidationError
from python_multipart.multipart import parse_options_header
from starlette.datastructures import Headers, UploadFile
from starlette.formparsers import FormParser, MultiPartException, MultiPartParser

from ditattn.attention.config import json_depth_exceeds, parse_error_reason
from ditattn.errors import short_repr
from ditattn.server.protocol import RequestError, unflatten_form, validation_error_to_request_error

MAX_FORM_FIELDS = 100
MAX_FORM_FILES = 4
FILE_FIELDS = ("input_reference",)  # uploads whose content a request may use


async def _read_limited(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and len(declared) < 20 and int(declared) > max_bytes:
        raise RequestError(
            f"request body too large ({declared} bytes; limit {max_bytes}, the server's --max-body-bytes)",
            status=413,
            code="body_too_large",
        )
    if declared is not None and declared.isdigit() and len(declared) >= 20:
        raise RequestError(
            f"request body too large (limit {max_bytes} bytes, the server's --max-body-bytes)",
            status=413,
            code="body_too_large",
        )
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise RequestError(
                f"request body too large (limit {max_bytes} bytes, the server's --max-body-bytes)",
                status=413,
                code="body_too_large",
            )
    return bytes(body)


#: the Content-Types a request body may have (none given: JSON)
ACCEPTED_TYPES = "application/json, multipart/form-data or application/x-www-form-urlencoded (UTF-8)"


class _Utf8MultiPartParser(MultiPartParser):
    """Starlette's multipart parser, but a text field must be UTF-8: Starlette would read other bytes as
    Latin-1 and a garbled prompt would be generated."""

    def on_part_end(self) -> None:
        part = self._current_part
        if part.file is None:
            try:
                bytes(part.data).decode("utf-8")
            except UnicodeDecodeError:
                raise MultiPartException(
                    f"form field {short_repr(part.field_name)} is not UTF-8 text; send text fields in UTF-8"
                ) from None
        super().on_part_end()


def _check_urlencoded(body: bytes) -> None:
    """400 unless every name and value of a url-encoded body is UTF-8 once percent-decoded (Starlette
    would put U+FFFD in place of other bytes)."""
    for piece in body.split(b"&"):
        name, _, value = piece.partition(b"=")
        for part in (name, value):
            try:
                unquote_to_bytes(part.replace(b"+", b" ")).decode("utf-8")
            except UnicodeDecodeError:
                shown = short_repr(unquote_to_bytes(name.replace(b"+", b" ")).decode("utf-8", "replace"))
                raise RequestError(
                    f"malformed form body: field {shown} is not UTF-8 once percent-decoded; percent-encode UTF-8 text"
                ) from None


def _content_type(header: str) -> tuple[str, dict]:
    """``(mime type in lower case, {parameter: value})`` of a Content-Type header, by python-multipart's
    parser (what Starlette's form parsers use); a ``charset`` other than UTF-8 is a 415 (the body would
    be read as UTF-8 anyway)."""
    mime, params = parse_options_header(header)
    params = {k.decode("latin-1").lower(): v for k, v in params.items()}
    charset = params.get("charset")
    if charset is not None and charset.decode("latin-1").lower() not in ("utf-8", "utf8"):
        raise RequestError(
            f"unsupported charset {short_repr(charset.decode('latin-1'))} in Content-Type; accepted: {ACCEPTED_TYPES}",
            status=415,
            code="unsupported_media_type",
        )
    return mime.decode("latin-1").lower(), params


async def _parse_form(headers: Headers, body: bytes, multipart: bool) -> list:
    async def stream():
        yield body
        yield b""

    try:
        if multipart:
            parser = _Utf8MultiPartParser(
                headers, stream(), max_files=MAX_FORM_FILES, max_fields=MAX_FORM_FIELDS, max_part_size=len(body) + 1
            )
            form = await parser.parse()
            boundary = _content_type(headers.get("content-type", ""))[1].get("boundary")
            if boundary and b"--" + boundary + b"--" not in body:
                raise RequestError(
                    "malformed form body: the multipart body ends before its closing boundary (truncated?)"
                )
        else:
            _check_urlencoded(body)
            form = await FormParser(headers, stream()).parse()
    except MultiPartException as exc:
        raise RequestError(f"malformed form body: {exc.message}") from None
    except (ValueError, UnicodeDecodeError):  # undecodable field names / values
        raise RequestError("malformed form body: it could not be decoded") from None
    items = []
    for name, value in form.multi_items():
        if isinstance(value, UploadFile):
            item = {"filename": value.filename}
            if name in FILE_FIELDS:  # bounded by the body limit already
                item.update(content_type=value.content_type, data=await value.read())
            items.append((name, item))
            await value.close()
        else:
            items.append((name, value))
    return items


class FormFields(dict):
    """A form body's fields (every value text), told apart from a JSON object so that fields strict in
    JSON (a ``lora`` scale must be a number there) still take the text a form sends."""


async def read_body(request: Request, max_bytes: int, max_depth: int = 32) -> dict:
    """The request body (at most ``max_bytes``, else 413) as a dict: a JSON object (nested at most
    ``max_depth`` deep, checked before parsing), or a multipart / url-encoded form.  Malformed
    bodies raise :class:`RequestError` (400)."""
    body = await _read_limited(request, max_bytes)
    mime = _content_type(request.headers.get("content-type", ""))[0]
    if mime == "application/x-www-form-urlencoded" and body.lstrip()[:1] in (b"{", b"["):
        raise RequestError(
            "the body looks like JSON but its Content-Type is application/x-www-form-urlencoded (what curl -d "
            "sends unless told otherwise); send it with Content-Type: application/json",
            status=415,
            code="unsupported_media_type",
        )
    if mime in ("multipart/form-data", "application/x-www-form-urlencoded"):
        items = await _parse_form(request.headers, body, mime == "multipart/form-data")
        return FormFields(unflatten_form(items, max_depth=max_depth))
    if mime and mime != "application/json" and not mime.endswith("+json"):
        raise RequestError(
            f"unsupported Content-Type {short_repr(mime)}; accepted: {ACCEPTED_TYPES}",
            status=415,
            code="unsupported_media_type",
        )
    if not body.strip():
        raise RequestError("empty request body; send a JSON object")
    if json_depth_exceeds(body, max_depth):
        raise RequestError(
            f"request body nests deeper than {max_depth} levels (the server's --max-json-depth)", code="body_too_deep"
        )
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, int digit limit
        raise RequestError(f"request body is not valid JSON: {parse_error_reason(exc)}") from None
    if not isinstance(data, dict):
        raise RequestError("request body must be a JSON object")
    return data


def validate(model_cls, data: dict):
    """``model_cls.model_validate(data)``, a validation error becoming one readable 400 (validation
    context ``form``: whether ``data`` came from a form, :class:`FormFields`)."""
    try:
        return model_cls.model_validate(data, context={"form": isinstance(data, FormFields)})
    except ValidationError as exc:
        raise validation_error_to_request_error(exc, model_cls) from None
