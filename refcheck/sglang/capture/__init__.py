"""Per-step capture of SGLang's speculative decoding, inside SGLang's scheduler processes.

Modules: ``steps`` (pure: SGLang verify tensors -> per-request step records), ``state`` (pure:
SGLang KV / mamba pools -> committed-state rows in refcheck's layouts), ``records`` (the capture
directory: records appended as frames of segment files, ``segments``, read back in order), ``assemble``
(records + generate results -> a refcheck :class:`~refcheck.trace.io.Trace`), ``versions`` (every SGLang-version
difference: hook targets, the Qwen3.5 DFlash patch) and ``hooks`` (the hooks :mod:`refcheck.sglang.plugin`, the
``sglang.srt.plugins`` entry point, installs; inert unless ``REFCHECK_CAPTURE_DIR`` is set). The layouts and
the drafter's side it shares with REFCHECK_DDTREE are :mod:`refcheck.sglang.layout` and
:mod:`refcheck.sglang.draft_side`; nothing here imports :mod:`refcheck.sglang.ddtree`.

Only ``hooks`` and ``versions`` import SGLang, and only when the hooks are installed, so the
rest is importable and tested on a CPU machine without SGLang.
"""
