"""refcheck/model_checks.py: the budget bound's memory estimate, and non-finite log-probs mid-decode."""

from __future__ import annotations

import pytest

from refcheck.errors import EXIT_MODEL, UsageError
from refcheck.model_checks import check_budget, tree_memory_bytes


def test_tree_memory_grows_with_the_square_of_the_budget() -> None:
    small = tree_memory_bytes(64, 128, 512, 6, 2048, 4)
    big = tree_memory_bytes(100_000, 128, 512, 6, 200_000, 4)
    assert small < 2 << 20  # the built-in pair at budget 64: about a MiB
    assert big > 100_000**2 * 5  # the ancestor matrix plus a float mask: > 50 GB at budget 100000


def test_budget_refused_by_memory_with_the_numbers() -> None:
    check_budget(64, 2048, 128, 512, 6, 4, "cpu", available=1 << 30)
    with pytest.raises(UsageError, match=r"--budget 20000: one tree verify needs about \d+\.\d+ GiB on cpu, more than "
                                         r"80% of the 1\.00 GiB available"):
        check_budget(20_000, 262_144, 128, 512, 6, 4, "cpu", available=1 << 30)
    with pytest.raises(UsageError, match="context of 2048 positions"):
        check_budget(2047, 2048, 128, 512, 6, 4, "cpu", available=1 << 40)
    check_budget(None, 2048, 128, 512, 6, 4, "cpu", available=1)  # chain mode: no tree


def test_non_finite_logprobs_mid_decode_name_the_prompt(cli, tmp_path, monkeypatch) -> None:
    from ddtree_reference.decode import DDTreeDecoder
    from ddtree_reference.tree import TreeError

    def nan_generate(self, prompt_ids):
        raise TreeError("draft_logprobs contains NaN")

    monkeypatch.setattr(DDTreeDecoder, "generate", nan_generate)
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": "first", "prompt_ids": [30, 31, 32]}\n')
    code, _, err = cli("run", "--prompts", str(p), "--max-new-tokens", "2")
    assert code == EXIT_MODEL and "Traceback" not in err
    assert "prompt first: non-finite log-probs while decoding (draft_logprobs contains NaN)" in err
