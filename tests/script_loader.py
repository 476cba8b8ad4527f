"""Load a file of scripts/ as a module (tests only): the scripts are not a package."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str) -> ModuleType:
    """``scripts/NAME.py`` imported under the module name NAME."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None, f"no script {name}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
