"""scripts/capture_cost.py's CPU parts: which cells it runs, in what order, and the deadline's record."""

from __future__ import annotations

import argparse

import pytest

from tests.script_loader import load_script

cc = load_script("capture_cost")


def _args(**kw) -> argparse.Namespace:
    base = {"algorithms": "NONE,DFLASH", "graphs": "off,on", "workloads": "one,mixed", "cells": None}
    return argparse.Namespace(**{**base, **kw})


def test_cells_default_to_every_combination_and_follow_an_explicit_list_in_order():
    assert cc.cells(_args())[:3] == [("NONE", False, "one"), ("NONE", False, "mixed"), ("NONE", True, "one")]
    assert len(cc.cells(_args())) == 8
    got = cc.cells(_args(cells="NGRAM:on:mixed,DFLASH:off:one"))
    assert got == [("NGRAM", True, "mixed"), ("DFLASH", False, "one")]
    for bad in ("NGRAM:yes:mixed", "NGRAM:on", "NGRAM:on:many"):
        with pytest.raises(ValueError, match="ALGORITHM:on|off:one|mixed"):
            cc.cells(_args(cells=bad))


def test_a_malformed_cell_or_round_budget_is_exit_2_and_a_passed_deadline_runs_nothing(tmp_path, capsys, monkeypatch):
    assert cc.main(["--out", str(tmp_path / "a"), "--cells", "X:on"]) == 2
    assert "is not ALGORITHM" in capsys.readouterr().err
    assert cc.main(["--out", str(tmp_path / "a"), "--cells", "NGRAM:on:mixed", "--round-budget", "0"]) == 2
    assert "the timing rounds' budget must be > 0 seconds, got 0.0" in capsys.readouterr().err
    monkeypatch.setattr(cc, "run_cell", lambda *a: pytest.fail("a cell ran past the deadline"))
    assert cc.main(["--out", str(tmp_path / "b"), "--cells", "NGRAM:on:mixed", "--deadline", "-1"]) == 0
    assert "cells not run: NGRAM:on:mixed" in capsys.readouterr().out
    assert not (tmp_path / "b" / "capture_cost.json").exists()
    assert (tmp_path / "b" / "capture_cost.md").read_text().count("\n") == 2  # the table's head, no row


def test_per_round_ratios_cancel_a_drift_the_medians_keep():
    """A kind's pass over the untraced pass of its own round: an engine slowing over the rounds moves the medians'
    ratio, not the per-round ones; rounds without both kinds are left out."""
    untraced = [1.0, 2.0, 3.0, 4.0]
    sampled = [1.05, 2.1, 3.15]  # 5 % slower in every round; one round short
    got = cc.per_round(sampled, untraced)
    assert got["rounds"] == 3 and got["min"] == pytest.approx(1.05) and got["max"] == pytest.approx(1.05)
    assert cc.per_round([], untraced) is None
    assert cc._spread(got) == " (rounds 1.05–1.05)" and cc._spread(None) == ""


def test_the_books_split_a_kinds_excess_over_the_untraced_passes_by_where_it_was_booked():
    """Two sampled passes: 10 plain batches at 1.2 ms (0.05 of it the pass-over) and 2 recorded at 3.0 against
    untraced plain batches of 1.0 ms; one recorded prefill at 12 and one plain at 10.5 against 10 ms. Per pass:
    pass-over 0.25, other plain 0.75, recorded 2.0, prefill 1.25 ms; over a 100 ms untraced pass, 1.0425×."""
    costs = {"untraced": {"plain_ms_per_batch": 1.0, "plain_prefill_ms_per_batch": 10.0},
             "sampled": {"plain_batches": 10, "plain_ms_per_batch": 1.2, "passed_ms_per_plain_batch": 0.05,
                         "recorded_batches": 2, "recorded_ms_per_batch": 3.0, "prefills": 1,
                         "prefill_ms_per_batch": 12.0, "plain_prefills": 1, "plain_prefill_ms_per_batch": 10.5}}
    got = cc.booked(costs, "sampled", 2, 0.1)
    want = {"pass_over": 0.25, "plain": 0.75, "recorded": 2.0, "prefill": 1.25, "ratio": 1.0425}
    assert got == pytest.approx(want)
    assert cc._booked(got) == ", booked 1.04×"
    assert cc.booked({"sampled": costs["sampled"]}, "sampled", 2, 0.1) is None  # no untraced books
    assert cc.booked(costs, "sampled", 0, 0.1) is None and cc._booked(None) == ""
    full = cc.booked({**costs, "full": {"recorded_batches": 4, "recorded_ms_per_batch": 2.5}}, "full", 2, 0.1)
    assert full == pytest.approx({"pass_over": 0.0, "plain": 0.0, "recorded": 3.0, "prefill": 0.0, "ratio": 1.03})
