"""Bad-input corpus entries of the golden store (manifests, journal, removals and regenerations, staging), joined to the corpus by
tests/test_bad_inputs.py (builders: tests/bad_input_kit.py)."""

from __future__ import annotations

from bad_input_kit import Bad

CASES: list[Bad] = []
