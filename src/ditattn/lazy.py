"""Public names that load on first use (PEP 562 module ``__getattr__``), so importing a package does
not import torch or diffusers before something needs them."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping


def lazy_getattr(package: str, namespace: dict, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``exports`` maps a public name to ``"module"`` (the
    name is that module's attribute of the same name) or ``"module:"`` (the name is the module
    itself); a loaded value is cached in ``namespace`` (the package's globals)."""

    def __getattr__(name: str) -> Any:
        spec = exports.get(name)
        if spec is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, colon, _ = spec.partition(":")
        loaded = importlib.import_module(module)
        value = loaded if colon else getattr(loaded, name)
        namespace[name] = value
        return value

    return __getattr__
