"""User-facing error types.

Every error caused by user input (a bad flag, an unknown backend, a backend that cannot serve a
call on this machine) is an :class:`AttentionConfigError` whose message says what was wrong and
what is accepted.  The CLI prints it as ``error: <message>`` and exits with status 2; the server
answers HTTP 400 with it.
"""

import operator
from typing import Any, Optional


def as_integer(value: Any) -> Optional[int]:
    """``value`` as a plain ``int`` when it is an integer: Python's, NumPy's (``np.int64``) or anything
    else ``operator.index`` takes (a one-element integer tensor); None for anything else, bools of every
    kind (``True``, ``np.bool_``, a bool tensor) included, so that a flag is never read as a count."""
    if type(value) is int:  # the common case, on ditattn.attention's per-call path: no more work
        return value
    if isinstance(value, bool) or "bool" in str(getattr(value, "dtype", "")):
        return None
    try:
        return operator.index(value)
    except (TypeError, ValueError, RuntimeError):  # RuntimeError: a meta tensor has no value to read
        return None


def short_repr(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages (a 5000-digit number or a
    megabyte string stays one short line)."""
    try:
        text = repr(value)
    except ValueError:  # an int too long for repr (more than sys.get_int_max_str_digits() digits), or holds one
        if isinstance(value, int):
            return f"an integer of about {int(value.bit_length() * 0.30103)} digits"
        return f"a {type(value).__name__} holding an integer too long to show"
    if len(text) <= limit:
        return text
    n = len(value) if isinstance(value, (str, bytes)) else len(text)  # a string's own length, not its repr's
    return f"{text[: limit - 20]}...{text[-12:]} ({n} {'bytes' if isinstance(value, bytes) else 'characters'})"


def short_text(text: Any, limit: int = 120) -> str:
    """``str(text)`` cut to ``limit`` characters as :func:`short_repr` cuts (a path or a flag value
    quoted in an error message without repr's quotes)."""
    text = str(text)
    return text if len(text) <= limit else f"{text[: limit - 20]}...{text[-12:]} ({len(text)} characters)"


class AttentionConfigError(ValueError):
    """A user-input error: the message names what was wrong and what is accepted."""


class BackendUnavailableError(AttentionConfigError):
    """An explicitly requested backend cannot serve a call here; ``reasons`` lists why."""

    def __init__(self, backend: str, reasons: list[str], what: str = "this call"):
        self.backend = backend
        self.reasons = list(reasons)
        super().__init__(f"attention backend '{backend}' cannot serve {what}: " + "; ".join(self.reasons))


class GenerationCancelled(Exception):
    """A generation stopped between denoising steps because its ``should_stop`` callable asked
    for it (a cancelled or timed-out request, a server shutting down); ``reason`` is what that
    callable returned.  Not a user-input error: the caller that asked for the stop handles it."""

    def __init__(self, reason: str):
        self.reason = str(reason)
        super().__init__(f"generation stopped: {self.reason}")

    def __reduce__(self):  # pickled with its reason (a replica's pipeline process sends it to the replica)
        return type(self), (self.reason,)
