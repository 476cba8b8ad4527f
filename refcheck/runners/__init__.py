"""Runners: the modules that drive one kind of engine each and record what its decoding did.

Contract: a runner is built from an :class:`~refcheck.runners.reference.EngineSpec` (plus its kind's
own options) and records a :class:`~refcheck.trace.io.Trace` of a prompt set. Nothing outside
:mod:`refcheck.engines` chooses a runner: the engine table there maps every ``--engine`` name to its
runner and is the interface (``name``, ``trace(prompts) -> Trace``) the diff, the parallel driver and
the CLI use. ``reference`` also serves the diff itself (the reference side of every comparison).
"""
