"""refcheck's SGLang plugin: the ``sglang.srt.plugins`` entry point, ``refcheck.sglang.plugin:register``.

Contract: SGLang calls :func:`register` (no arguments) in its main process and again in every spawned scheduler
process, before the scheduler is built (``pyproject.toml`` declares the entry point; the runner's
:func:`~refcheck.sglang.runner.install_entry_point` declares the same one for the processes it starts). It always
applies the model fixes of :func:`refcheck.sglang.capture.versions.patch_models` (DFLASH needs them whether or not
anything is captured) and registers refcheck's DDTree algorithms
(:func:`refcheck.sglang.ddtree.algorithm.register_algorithm`, which does nothing where SGLang is absent), then
hands what it patched to the capture (:func:`refcheck.sglang.capture.hooks.install`: inert unless
``REFCHECK_CAPTURE_DIR`` is set). A second call does nothing. This is the one module that imports both the capture
and the algorithm; neither imports the other.
"""

from __future__ import annotations

from refcheck.sglang.capture import hooks, versions
from refcheck.sglang.ddtree.algorithm import register_algorithm

_registered = False


def register() -> None:
    """The entry point (``[project.entry-points."sglang.srt.plugins"] refcheck``)."""
    global _registered
    if _registered:
        return
    _registered = True
    patched = versions.patch_models()
    if register_algorithm():
        patched.append("speculative algorithm REFCHECK_DDTREE")
    hooks.install(patched)
