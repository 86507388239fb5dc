"""User-facing error types.

Every error caused by user input (a bad flag, an unknown backend, a backend that cannot serve a
call on this machine) is an :class:`AttentionConfigError` whose message says what was wrong and
what is accepted.  The CLI prints it as ``error: <message>`` and exits with status 2; the server
answers HTTP 400 with it.
"""


class AttentionConfigError(ValueError):
    """A user-input error: the message names what was wrong and what is accepted."""


class BackendUnavailableError(AttentionConfigError):
    """An explicitly requested backend cannot serve a call here; ``reasons`` lists why."""

    def __init__(self, backend: str, reasons: list[str], what: str = "this call"):
        self.backend = backend
        self.reasons = list(reasons)
        super().__init__(
            f"attention backend '{backend}' cannot serve {what}: " + "; ".join(self.reasons)
        )
