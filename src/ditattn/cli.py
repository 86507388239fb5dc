"""The ``ditattn`` console script (``ditattn.cli:main``); the command line itself is
:mod:`ditattn.entrypoints.cli`."""

from ditattn.entrypoints.cli import main

__all__ = ["main"]
