"""Runners: the modules that drive one kind of engine each and record what its decoding did (z-lab's ``dflash``
here; SGLang's runner is :mod:`refcheck.sglang.runner`, beside the rest of refcheck's SGLang code).

Contract: a runner is built from an :class:`~refcheck.reference_runner.EngineSpec` (plus its kind's
own options) and records a :class:`~refcheck.trace.io.Trace` of a prompt set. The engine table
(:mod:`refcheck.engines`) maps every ``--engine`` name to its runner and is the interface (``name``,
``trace(prompts) -> Trace``) the CLI, the parallel driver and calibrate use; scripts that drive one
engine on purpose (``scripts/sglang_suite.py``) may build its runner directly. The reference itself (:mod:`refcheck.reference_runner`) is not here: the diff runs it too.
"""
