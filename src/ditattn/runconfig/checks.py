"""Value checks of the run configuration, shared by its fields and the command-line flags.

Each takes a value, or its text as the command line and YAML give it, and returns it typed, or
raises ``ValueError("expected ..., got ...")`` (the flags turn that into argparse's one-line error,
the config into :class:`~ditattn.errors.AttentionConfigError` naming the key).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Union


def _integer(value: Any, ok: Callable[[int], bool], expected: str) -> int:
    if isinstance(value, str):
        try:
            number = int(value.strip())
        except ValueError:
            raise ValueError(f"expected {expected}, got {value!r}") from None
    elif isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        raise ValueError(f"expected {expected}, got {value!r}")
    if not ok(number):
        raise ValueError(f"expected {expected}, got {number}")
    return number


def positive_int(value: Any) -> int:
    return _integer(value, lambda v: v > 0, "a positive integer")


def nonneg_int(value: Any) -> int:
    return _integer(value, lambda v: v >= 0, "an integer >= 0")


def tcp_port(value: Any) -> int:
    return _integer(value, lambda v: 1 <= v <= 65535, "a TCP port 1-65535")


def _number(value: Any, ok: Callable[[float], bool], expected: str, unparsable: str = "a number") -> float:
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"expected {unparsable}, got {value!r}") from None
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:
            raise ValueError(f"expected {expected}, got {value!r}") from None
    else:
        raise ValueError(f"expected {unparsable}, got {value!r}")
    if not ok(number):  # nan/inf would silently produce a NaN video
        raise ValueError(f"expected {expected}, got {value!r}")
    return number


def finite_float(value: Any) -> float:
    return _number(value, math.isfinite, "a finite number")


def positive_float(value: Any) -> float:
    return _number(value, lambda v: math.isfinite(v) and v > 0, "a positive number", "a positive number")


def nonneg_float(value: Any) -> float:
    return _number(value, lambda v: math.isfinite(v) and v >= 0, "a number >= 0", "a number >= 0")


def boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    low = str(value).strip().lower() if isinstance(value, (str, int)) else None
    if low in ("true", "1", "yes", "on"):
        return True
    if low in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {value!r}")


def text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


def text_or_mapping(value: Any) -> Union[str, dict]:
    if isinstance(value, Mapping):
        return dict(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a string or a mapping, got {value!r}")
    return value


def one_of(*choices: str) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if value not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {value!r}")
        return value

    return check


def optional(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``check`` for a field whose value may also be None (unset)."""
    def maybe(value: Any) -> Any:
        return None if value is None else check(value)

    return maybe


def lora_specs(value: Any) -> tuple:
    """LoRA adapters: one ``[COMPONENT=]PATH[:SCALE]`` string or a list of them (checked by
    :func:`ditattn.models.lora.parse_lora_spec`), returned as a tuple of strings."""
    from ditattn.models.lora import parse_lora_spec

    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"expected [COMPONENT=]PATH[:SCALE] strings, got {value!r}")
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
        raise ValueError(f"expected comma-separated package names or a list, got {value!r}")
    return parse_platform_packages(value)
