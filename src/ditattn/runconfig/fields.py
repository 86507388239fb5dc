"""The building blocks of the run configuration's sections: a field with its check and help
(:func:`setting`), the base that checks every field on construction (:class:`Section`) and the
bounds of the numeric settings."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from ditattn.errors import AttentionConfigError


def setting(default: Any, check: Callable[[Any], Any], help: str, *, metavar: Optional[str] = None) -> Any:
    """A dataclass field whose value ``check`` validates (and types) on construction; ``help``: the
    option's one description, for messages and ``--help``; ``metavar``: its value's name in ``--help``
    (:func:`ditattn.entrypoints.flags.field_flags` builds the flag from these)."""
    return dataclasses.field(default=default, metadata={"check": check, "help": help, "metavar": metavar})


class Section:
    """Validates (and types) every field on construction."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            try:
                object.__setattr__(self, f.name, f.metadata["check"](getattr(self, f.name)))
            except ValueError as exc:
                raise AttentionConfigError(f"{f.name}: {exc}") from None


# Bounds of the numeric settings: far beyond any real run, small enough that no value reaches code
# that would overflow on it (a 30-digit step count, a seed past 64 bits, a 1e300 guidance scale).
MAX_STEPS = 1000
MAX_SIDE = 16384
MAX_FRAMES = 1025
MAX_SEED = 2**63 - 1
MAX_GUIDANCE = 100.0
MAX_FPS = 240
MAX_GPUS = 1024
