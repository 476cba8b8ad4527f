"""Bad-input corpus entries of the command line, traces' provenance, prompts, output paths and workers, joined to the corpus by
tests/test_bad_inputs.py (builders: tests/bad_input_kit.py)."""

from __future__ import annotations

from bad_input_kit import Bad

CASES: list[Bad] = []
