"""Progress (refcheck/progress.py): producers hand finished lines to one callable shape."""

from __future__ import annotations

from refcheck.progress import tell
from refcheck.prompts import load_prompts
from refcheck.reference_runner import EngineSpec, ReferenceRunner


def test_tell_is_silent_without_a_consumer():
    lines: list[str] = []
    tell(None, "x")
    tell(lines.append, "y")
    assert lines == ["y"]


def test_the_reference_run_reports_each_prompt_as_one_line():
    prompts = load_prompts()[:2]
    lines: list[str] = []
    ReferenceRunner(EngineSpec(pair="hybrid", drafter="scripted", budget=2, max_new_tokens=2)).run(prompts, progress=lines.append)
    assert lines == [f"[1/2] {prompts[0].id}", f"[2/2] {prompts[1].id}"]
