"""A package's names loaded on first use (PEP 562), so importing the package alone loads no heavy library.

Contract: ``__getattr__ = lazy_exports(__name__, {"Name": "submodule", ...}, globals())`` in a package's
``__init__`` resolves ``package.Name`` by importing ``package.submodule`` on first access and caches the value
in the package's namespace; any other name raises ``AttributeError`` as a module does.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    return __getattr__
