"""Value checks of the run configuration, shared by its fields and the command-line flags.

Each takes a value, or its text as the command line and YAML give it, and returns it typed, or
raises ``ValueError("expected ..., got ...")`` (the flags turn that into argparse's one-line error,
the config into :class:`~ditattn.errors.AttentionConfigError` naming the key).
"""

from __future__ import annotations

import enum
import math
import numbers
import re
from typing import Any, Callable, Mapping, Union

from ditattn.errors import as_integer
from ditattn.errors import short_repr as _short


def _integer(value: Any, ok: Callable[[int], bool], expected: str) -> int:
    if isinstance(value, str):
        text = value.strip()
        if len(text) > 100:  # int() of a 5000-digit string is refused by Python (or is slow)
            raise ValueError(f"expected {expected}, got {_short(value)}")
        try:
            number = int(text)
        except ValueError:
            raise ValueError(f"expected {expected}, got {_short(value)}") from None
    else:
        number = as_integer(value)  # Python's or NumPy's integers (np.int64) as a plain int; never a bool
        if number is None:
            raise ValueError(f"expected {expected}, got {_short(value)}")
    if not ok(number):
        raise ValueError(f"expected {expected}, got {_short(number)}")
    return number


def positive_int(value: Any) -> int:
    return _integer(value, lambda v: v > 0, "a positive integer")


def nonneg_int(value: Any) -> int:
    return _integer(value, lambda v: v >= 0, "an integer >= 0")


def tcp_port(value: Any) -> int:
    return _integer(value, lambda v: 1 <= v <= 65535, "a TCP port 1-65535")


def int_between(lo: int, hi: int) -> Callable[[Any], int]:
    """An integer in ``[lo, hi]`` (text accepted); the bound keeps absurd values (a 30-digit step
    count or seed) from reaching code that would overflow on them."""
    expected = f"a positive integer up to {hi}" if lo == 1 else f"an integer from {lo} to {hi}"

    def check(value: Any) -> int:
        return _integer(value, lambda v: lo <= v <= hi, expected)

    check.__name__ = "integer"
    return check


def _is_real(value: Any) -> bool:
    """A real number that is not a bool: Python's int / float or NumPy's (``np.float32``, ``np.int64``)."""
    if isinstance(value, bool) or "bool" in str(getattr(value, "dtype", "")):
        return False
    return isinstance(value, numbers.Real)


def _number(value: Any, ok: Callable[[float], bool], expected: str, unparsable: str = "a number") -> float:
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"expected {unparsable}, got {_short(value)}") from None
    elif _is_real(value):
        try:
            number = float(value)
        except OverflowError:
            raise ValueError(f"expected {expected}, got {_short(value)}") from None
    else:
        raise ValueError(f"expected {unparsable}, got {_short(value)}")
    if not ok(number):  # nan/inf would silently produce a NaN video
        raise ValueError(f"expected {expected}, got {_short(value)}")
    return number


def finite_float(value: Any) -> float:
    return _number(value, math.isfinite, "a finite number")


def positive_float(value: Any) -> float:
    return _number(value, lambda v: math.isfinite(v) and v > 0, "a positive number", "a positive number")


def nonneg_float(value: Any) -> float:
    return _number(value, lambda v: math.isfinite(v) and v >= 0, "a number >= 0", "a number >= 0")


def float_between(lo: float, hi: float, *, lo_open: bool = False) -> Callable[[Any], float]:
    """A finite number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``); text accepted."""
    expected = (
        f"a positive number up to {hi:g}"
        if lo_open and lo == 0
        else f"a finite number from {lo:g} to {hi:g}"
        if not lo_open
        else f"a number above {lo:g} up to {hi:g}"
    )

    def check(value: Any) -> float:
        return _number(
            value, lambda v: math.isfinite(v) and (v > lo if lo_open else v >= lo) and v <= hi, expected, expected
        )

    check.__name__ = "number"
    return check


def boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    low = str(value).strip().lower() if isinstance(value, (str, int)) else None
    if low in ("true", "1", "yes", "on"):
        return True
    if low in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {_short(value)}")


def text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {_short(value)}")
    return value


def _plain(value: Any) -> Any:
    """An enum member as its value, a ``torch.dtype`` / ``torch.device`` as its name (``float32``,
    ``cuda:1``); anything else unchanged (Python callers may pass the objects, the CLI passes text)."""
    if isinstance(value, enum.Enum):
        return value.value
    kind = type(value)
    if kind.__module__ == "torch" and kind.__name__ in ("dtype", "device"):
        return str(value).replace("torch.", "")
    return value


def nonempty_text(value: Any) -> str:
    """Text with something in it: an empty value is refused rather than read as "not given"."""
    value = text(value)
    if not value.strip():
        raise ValueError("expected a non-empty value (leave the setting out for its default)")
    return value


#: what a job store URL may start with (PostgreSQL), besides ``sqlite``
JOB_STORE_SCHEMES = ("postgresql://", "postgres://")


def job_store_url(value: Any) -> str:
    """``sqlite`` or a ``postgresql://`` / ``postgres://`` URL."""
    value = nonempty_text(value)
    if value != "sqlite" and not value.startswith(JOB_STORE_SCHEMES):
        raise ValueError(f"expected sqlite or a postgresql://USER@HOST:PORT/DB URL, got {_short(value)}")
    return value


def web_origin(value: Any) -> str:
    """A browser Origin, ``scheme://host[:port]`` with scheme http or https, or ``*`` (any)."""
    value = nonempty_text(value).strip()
    if value != "*" and not re.fullmatch(r"https?://[^/\s:]+(:\d{1,5})?/?", value, re.IGNORECASE):
        raise ValueError(f"expected an origin (https://example.com, http://host:8080 or *), got {_short(value)}")
    return value


def plain_name(value: Any) -> str:
    """A name as text (not empty), or an enum member / torch dtype / torch device (see :func:`_plain`)."""
    return nonempty_text(_plain(value))


def text_or_mapping(value: Any) -> Union[str, dict]:
    """A spec string, or a mapping (its enum values as their names)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if not isinstance(value, str):
        raise ValueError(f"expected a string or a mapping, got {_short(value)}")
    return value


def one_of(*choices: str) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        value = _plain(value)
        if value not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {_short(value)}")
        return value

    check.choices = choices  # the flag lists them (ditattn.entrypoints.flags.field_flags)
    return check


def optional(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``check`` for a field whose value may also be None (unset)."""

    def maybe(value: Any) -> Any:
        return None if value is None else check(value)

    if hasattr(check, "choices"):
        maybe.choices = check.choices
    return maybe


def lora_specs(value: Any) -> tuple:
    """LoRA adapters: one ``[COMPONENT=]PATH[:SCALE]`` string or a list of them (checked by
    :func:`ditattn.models.lora.parse_lora_spec`), returned as a tuple of strings."""
    from ditattn.models.lora import parse_lora_spec

    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"expected [COMPONENT=]PATH[:SCALE] strings, got {_short(value)}")
    for v in value:
        parse_lora_spec(v)  # AttentionConfigError is a ValueError: same one-line message
    return tuple(v.strip() for v in value)


def platform_spec(value: Any) -> str:
    """A simulated platform ``NAME[:SM]`` (``cuda:90``, ``xpu``; see
    :func:`ditattn.platforms.parse_platform_spec`), returned normalised (stripped, lower case)."""
    from ditattn.platforms import parse_platform_spec

    parse_platform_spec(text(value))  # AttentionConfigError is a ValueError: same one-line message
    return value.strip().lower()


def package_list(value: Any) -> tuple:
    """Packages of a simulated platform: ``"a,b"`` or a list of import names, each optionally
    ``name==version`` (see :func:`ditattn.platforms.parse_platform_packages`)."""
    from ditattn.platforms import parse_platform_packages

    if not isinstance(value, (str, list, tuple)):
        raise ValueError(f"expected comma-separated package names or a list, got {_short(value)}")
    return parse_platform_packages(value)


def public_url(value: Any) -> str:
    """An absolute ``http(s)://host[:port][/path]`` base URL (no query or fragment), returned without
    a trailing slash."""
    from urllib.parse import urlsplit

    url = text(value).strip()
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (raises ValueError for a bad port)
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ValueError(
            f"expected an absolute http(s) URL such as https://images.example.com/ditattn, got {_short(value)}"
        )
    return url.rstrip("/")


def list_of(check: Callable[[Any], Any], what: str) -> Callable[[Any], tuple]:
    """A tuple of values each passing ``check``: from a list/tuple, or from one comma-separated
    string (``"0,-1"``); ``what`` names the items in messages."""

    def items(value: Any) -> tuple:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"expected a list of {what}, got {_short(value)}")
        return tuple(check(v) for v in value)

    return items


def integer(value: Any) -> int:
    return _integer(value, lambda v: True, "an integer")


def text_items(value: Any) -> tuple:
    """A tuple of strings (a list/tuple of strings; one string is one item, commas included)."""
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"expected a list of strings, got {_short(value)}")
    return tuple(value)


def timestep_list(value: Any) -> tuple:
    """An explicit denoising schedule: ``"1000,750,500,250"`` or a list of numbers, each in (0, 1e6],
    strictly descending (so no duplicates), at most ``MAX_STEPS`` of them; returned as a tuple of floats.
    The upper bound that matters, the checkpoint's ``num_train_timesteps``, is checked when the
    scheduler is built (:func:`ditattn.pipelines.sampling.build_sampler`)."""
    from ditattn.runconfig.fields import MAX_STEPS

    expected = "descending timesteps such as 1000,750,500,250"
    items = [v for v in value.split(",")] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items or len(items) > MAX_STEPS:
        raise ValueError(f"expected 1 to {MAX_STEPS} {expected}, got {_short(value)}")
    what = f"timesteps above 0 ({expected})"
    out = tuple(
        _number(v.strip() if isinstance(v, str) else v, lambda x: math.isfinite(x) and 0 < x <= 1e6, what, what)
        for v in items
    )
    for a, b in zip(out, out[1:], strict=False):
        if not b < a:
            what = "a duplicate" if a == b else "not descending"
            raise ValueError(
                f"expected {expected} (strictly descending, no duplicates), got {_short(value)} "
                f"({what}: {a:g} then {b:g})"
            )
    return out


def fraction_interval(value: Any) -> tuple:
    """A part of the denoising schedule ``START:END`` (text, or a pair of numbers), fractions with
    ``0 <= START < END <= 1``; returned as ``(START, END)`` floats."""
    expected = "START:END with 0 <= START < END <= 1, e.g. 0:0.5"
    parts = value.split(":") if isinstance(value, str) else value
    if not isinstance(parts, (list, tuple)) or len(parts) != 2:
        raise ValueError(f"expected {expected}, got {_short(value)}")
    start, end = (
        _number(p.strip() if isinstance(p, str) else p, lambda x: math.isfinite(x) and 0 <= x <= 1, expected, expected)
        for p in parts
    )
    if not start < end:
        raise ValueError(f"expected {expected}, got {_short(value)} (START must be below END)")
    return (start, end)
