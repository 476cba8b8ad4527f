"""Runners: things that decode prompts and report what their speculative decoding did.

Contract (the runner interface the SGLang and z-lab runners implement too): a runner is built
from an :class:`~refcheck.runners.reference.EngineSpec` and has ``name`` and
``run(prompts, progress=None) -> list[DecodeResult]``; each result carries per-step records
(tree, accepted nodes, bonus, emitted tokens, target top-k log-probs, timings).
"""
