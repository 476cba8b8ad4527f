"""scripts/capture_cost.py's CPU parts: which cells it runs, in what order, and the deadline's record; its readings
(scripts/capture_cost_readings.py) and its table (scripts/capture_cost_table.py)."""

from __future__ import annotations

import argparse
import gzip
import json
import math

import pytest
from script_loader import load_script

cc = load_script("capture_cost")  # puts scripts/ on sys.path: its readings and table import by name
import capture_cost_readings as rd  # noqa: E402
import capture_cost_table as tb  # noqa: E402


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


def test_a_malformed_cell_round_budget_or_sampling_rate_is_exit_2_and_a_passed_deadline_runs_nothing(tmp_path, capsys, monkeypatch):
    assert cc.main(["--out", str(tmp_path / "a"), "--cells", "X:on"]) == 2
    assert "is not ALGORITHM" in capsys.readouterr().err
    assert cc.main(["--out", str(tmp_path / "a"), "--cells", "NGRAM:on:mixed", "--round-budget", "0"]) == 2
    assert "the timing rounds' budget must be > 0 seconds, got 0.0" in capsys.readouterr().err
    assert cc.main(["--out", str(tmp_path / "a"), "--cells", "NGRAM:on:mixed", "--sample", "0"]) == 2
    assert "capture sampling takes 1 batch in N for N in 1..1000000, got 0" in capsys.readouterr().err
    monkeypatch.setattr(cc, "run_engine", lambda *a: pytest.fail("a cell ran past the deadline"))
    assert cc.main(["--out", str(tmp_path / "b"), "--cells", "NGRAM:on:mixed", "--deadline", "-1"]) == 0
    assert "cells not run: NGRAM:on:mixed" in capsys.readouterr().out
    assert not (tmp_path / "b" / "capture_cost.json").exists()
    assert (tmp_path / "b" / "capture_cost.md").read_text().count("\n") == 2  # the table's head, no row


def test_per_round_ratios_cancel_a_drift_the_medians_keep():
    """A kind's pass over the untraced pass of its own round: an engine slowing over the rounds moves the medians'
    ratio, not the per-round ones; rounds without both kinds are left out."""
    untraced = [1.0, 2.0, 3.0, 4.0]
    sampled = [1.05, 2.1, 3.15]  # 5 % slower in every round; one round short
    got = rd.per_round(sampled, untraced)
    assert got["rounds"] == 3 and got["min"] == pytest.approx(1.05) and got["max"] == pytest.approx(1.05)
    assert rd.per_round([], untraced) is None
    assert tb._spread(got) == " (per round 1.050 of 3, 1.05–1.05)" and tb._spread(None) == ""


def test_the_books_split_a_kinds_excess_over_the_untraced_passes_by_where_it_was_booked():
    """Two sampled passes: 10 plain batches at 1.2 ms (0.05 of it the pass-over) and 2 recorded at 3.0 against
    untraced plain batches of 1.0 ms; one recorded prefill at 12 and one plain at 10.5 against 10 ms. Per pass:
    pass-over 0.25, other plain 0.75, recorded 2.0, prefill 1.25 ms; over a 100 ms untraced pass, 1.0425×."""
    costs = {"untraced": {"plain_ms_per_batch": 1.0, "plain_prefill_ms_per_batch": 10.0},
             "sampled": {"plain_batches": 10, "plain_ms_per_batch": 1.2, "passed_ms_per_plain_batch": 0.05,
                         "recorded_batches": 2, "recorded_ms_per_batch": 3.0, "prefills": 1,
                         "prefill_ms_per_batch": 12.0, "plain_prefills": 1, "plain_prefill_ms_per_batch": 10.5}}
    got = rd.booked(costs, "sampled", 2, 0.1)
    want = {"pass_over": 0.25, "plain": 0.75, "recorded": 2.0, "prefill": 1.25, "ratio": 1.0425}
    assert got == pytest.approx(want)
    assert tb._booked(got) == ", booked 1.04×"
    steps = rd.per_round([0.104] * 6, [0.1] * 6)
    assert tb._booked(got, steps) == ", booked 1.04×; run_batch per round 1.040 [1.040–1.040]"
    assert rd.booked({"sampled": costs["sampled"]}, "sampled", 2, 0.1) is None  # no untraced books
    assert rd.booked(costs, "sampled", 0, 0.1) is None and tb._booked(None) == ""
    full = rd.booked({**costs, "full": {"recorded_batches": 4, "recorded_ms_per_batch": 2.5}}, "full", 2, 0.1)
    assert full == pytest.approx({"pass_over": 0.0, "plain": 0.0, "recorded": 3.0, "prefill": 0.0, "ratio": 1.03})


def test_the_median_interval_is_the_order_statistics_of_the_binomial_rule_and_covers_the_median():
    """[x_(k), x_(n+1-k)] for the largest k with P(Bin(n, 1/2) < k) <= 2.5 %: k = 1 at 6 rounds (1/64), 2 at 9
    (10/512), 3 at 12 (79/4096); none under 6. Over 2000 seeded draws of 11 skewed ratios the interval holds the
    distribution's median at least 95 % of the time."""
    import random

    assert rd.median_interval([1.0] * 5) is None
    assert rd.median_interval([6.0, 1.0, 5.0, 2.0, 4.0, 3.0]) == (1.0, 6.0)
    assert rd.median_interval(list(range(9))) == (1, 7) and rd.median_interval(list(range(12))) == (2, 9)
    rng, median, hits = random.Random(7), 1.0 + math.log(2) / 20, 0  # exponential(rate 20) above 1: median ln 2 / 20
    for _ in range(2000):
        lo, hi = rd.median_interval([1.0 + rng.expovariate(20) for _ in range(11)])
        hits += lo <= median <= hi
    assert hits >= 0.95 * 2000, hits


def test_a_kind_is_within_over_or_undecided_against_its_target_by_its_interval():
    """within: the interval's top at or under the limit; over: its bottom above; undecided: it straddles; a row's
    target column reads full against 1.5 (graphs) or 1.3 (eager), and sampled against 1.05."""
    within = rd.per_round([1.01, 1.02, 1.03, 1.04, 1.05, 1.02], [1.0] * 6)
    over = rd.per_round([1.06, 1.07, 1.08, 1.09, 1.10, 1.07], [1.0] * 6)
    straddle = rd.per_round([1.01, 1.04, 1.06, 1.07, 1.02, 1.09], [1.0] * 6)
    assert [rd.against(r, 1.05) for r in (within, over, straddle)] == ["within", "over", "undecided"]
    assert rd.against(rd.per_round([1.2] * 5, [1.0] * 5), 1.05) == "—" and rd.against(None, 1.05) == "—"
    assert tb._spread(within) == " (per round 1.025 [1.010–1.050] of 6, 1.01–1.05)"
    row = {"graphs": False, "target": {"full": "within", "sampled": "undecided"}}
    assert tb._target(row) == "≤1.3: within / ≤1.05: undecided"


def test_an_undecided_reading_says_about_how_many_rounds_would_decide_it():
    """The interval's half-width on the median's side of the line, scaled as one over the root of the rounds: a
    median 1.04 whose interval reaches 1.054 at 143 rounds clears 1.05 at about 143 * (0.014 / 0.010)^2 rounds; a
    decided reading, one without an interval, and a median on the line give none. The figure is printed beside the
    reading, and the estimate holds on data: 4 times the rounds of the same spread decide it."""
    import random

    undecided = {"median": 1.04, "ci95": (1.026, 1.054), "rounds": 143}
    assert rd.rounds_to_decide(undecided, 1.05) == 281
    above = {"median": 1.06, "ci95": (1.045, 1.07), "rounds": 40}
    assert rd.rounds_to_decide(above, 1.05) == 90  # 40 * (0.015 / 0.010)^2
    assert rd.rounds_to_decide({"median": 1.02, "ci95": (1.01, 1.04), "rounds": 50}, 1.05) is None  # within
    assert rd.rounds_to_decide({"median": 1.05, "ci95": (1.04, 1.06), "rounds": 50}, 1.05) is None
    assert rd.rounds_to_decide(None, 1.05) is None
    row = {"graphs": True, "target": {"full": "within", "sampled": "undecided"},
           "decide_rounds": {"full": None, "sampled": 281}}
    assert tb._target(row) == "≤1.5: within / ≤1.05: undecided (~281 rounds)"
    rng = random.Random(5)
    draw = [1.04 + rng.gauss(0, 0.05) for _ in range(4000)]
    few = rd.per_round(draw[:100], [1.0] * 100)
    need = rd.rounds_to_decide(few, 1.05)
    assert rd.against(few, 1.05) == "undecided" and need is not None and need > 100
    assert rd.against(rd.per_round(draw[:4 * need], [1.0] * (4 * need)), 1.05) == "within"


def test_reread_prints_an_earlier_runs_table_with_the_per_round_reading_and_refuses_what_is_not_one(tmp_path, capsys):
    """--reread: rows with passes get their per-round ratios and target recomputed (six rounds at 1.10: over 1.05);
    a deadline row without passes is left out; an unreadable file or one that is not a list of rows is exit 2."""
    row = {"algorithm": "DFLASH", "graphs": True, "workload": "mixed", "steps": 10, "untraced_s": 1.0,
           "overhead_full": 1.4, "overhead_sampled": 1.1, "bytes_per_step": 100.0, "tokens_same_untraced": True,
           "tokens_same_sampled": True, "passes": {"untraced": [1.0] * 6, "sampled": [1.1] * 6, "full": [1.4] * 6},
           "pass_costs": {"untraced": {"run_batch_s": [0.5] * 6}, "sampled": {"run_batch_s": [0.51] * 6}}}
    (tmp_path / "a.json").write_text(json.dumps([row, {"cells_not_run": ["NGRAM:on:one"]}]))
    assert cc.main(["--reread", str(tmp_path / "a.json")]) == 0
    table = capsys.readouterr().out.strip().splitlines()
    assert len(table) == 3 and table[2].endswith("| ≤1.5: within / ≤1.05: over |"), table
    assert "(per round 1.100 [1.100–1.100] of 6, 1.10–1.10); run_batch per round 1.020 [1.020–1.020]" in table[2]
    (tmp_path / "b.json").write_text(json.dumps({"rows": []}))
    assert cc.main(["--reread", str(tmp_path / "b.json")]) == 2
    assert "is not a list of rows" in capsys.readouterr().err
    assert cc.main(["--reread", str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_reread_reads_gzipped_rows_as_the_plain_file_and_refuses_a_broken_archive(tmp_path, capsys):
    """--reread of rows.json.gz prints the table rows.json prints; a .gz that is not gzip, is cut short or has a byte
    damaged inside is exit 2 with the file named."""
    row = {"algorithm": "NGRAM", "graphs": False, "workload": "one", "steps": 7, "untraced_s": 0.02,
           "overhead_full": 1.2, "overhead_sampled": 1.0, "bytes_per_step": 50.0, "tokens_same_untraced": True,
           "tokens_same_sampled": True, "passes": {"untraced": [1.0, 1.1, 0.9], "sampled": [1.0, 1.2, 0.9],
                                                   "full": [1.3, 1.4, 1.2]}}
    text = json.dumps([row], separators=(",", ":"))
    (tmp_path / "rows.json").write_text(text)
    packed = gzip.compress(text.encode())
    (tmp_path / "rows.json.gz").write_bytes(packed)
    assert cc.main(["--reread", str(tmp_path / "rows.json")]) == 0
    plain = capsys.readouterr().out
    assert cc.main(["--reread", str(tmp_path / "rows.json.gz")]) == 0
    assert capsys.readouterr().out == plain and "| NGRAM | off | one | 7 |" in plain
    mid = len(packed) // 2
    damaged = packed[:mid] + bytes([packed[mid] ^ 0xFF]) + packed[mid + 1:]
    for name, data in (("text.json.gz", text.encode()), ("cut.json.gz", packed[:mid]), ("bad.json.gz", damaged)):
        (tmp_path / name).write_bytes(data)
        assert cc.main(["--reread", str(tmp_path / name)]) == 2
        assert f"cannot read {tmp_path / name}" in capsys.readouterr().err


def test_no_full_asks_the_runner_for_rounds_without_a_full_capture_pass(tmp_path, monkeypatch):
    """--no-full reaches the runner as full_timing=False (and its absence as True), with the round budget."""
    from refcheck.errors import UsageError
    from refcheck.sglang import runner

    seen: list[dict] = []

    def fake(*args, **kw):
        seen.append(kw)
        raise UsageError("no engine here")

    monkeypatch.setattr(runner, "SGLangRunner", fake)
    for extra in ([], ["--no-full"]):
        assert cc.main(["--out", str(tmp_path), "--cells", "DFLASH:on:mixed", "--round-budget", "5", *extra]) == 0
    assert [(kw["full_timing"], kw["timing_budget_s"]) for kw in seen] == [(True, 5.0), (False, 5.0)]
    assert "error: UsageError: no engine here" in (tmp_path / "capture_cost.md").read_text()


def test_until_reaches_the_runner_as_a_wall_clock_end_and_no_cell_starts_past_it(tmp_path, monkeypatch, capsys):
    """--until S: each cell's runner gets timing_until_s = the script's start + S on the wall clock; once S seconds
    have passed no cell starts (they are listed as not run); a non-positive --until is exit 2 before any cell."""
    from refcheck.errors import UsageError
    from refcheck.sglang import runner

    seen: list[dict] = []
    clock = [500.0]

    def fake(*args, **kw):
        seen.append(kw)
        clock[0] += 30.0  # a cell takes 30 s
        raise UsageError("no engine here")

    monkeypatch.setattr(runner, "SGLangRunner", fake)
    monkeypatch.setattr(cc.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(cc.time, "time", lambda: 1e9 + clock[0])
    cells = "DFLASH:on:mixed,NGRAM:on:mixed,NONE:on:mixed"
    assert cc.main(["--out", str(tmp_path), "--cells", cells, "--until", "45"]) == 0
    assert [kw["timing_until_s"] for kw in seen] == [1e9 + 545.0] * 2  # the third would start at 60 s
    assert "deadline reached, cells not run: NONE:on:mixed" in capsys.readouterr().out
    for bad in ("0", "-3", "nan"):
        assert cc.main(["--out", str(tmp_path), "--cells", cells, "--until", bad]) == 2
        assert "--until must be > 0 seconds" in capsys.readouterr().err
    assert len(seen) == 2


def test_model_and_draft_run_the_cells_on_that_pair_and_the_rows_name_it(tmp_path, monkeypatch, capsys):
    """--model DIR --draft DIR reach the runner's spec as the pair's directories (the built-in --pair otherwise) and
    each row names its pair; a --model that is not a directory, or a --draft without --model, is exit 2."""
    from refcheck.errors import UsageError
    from refcheck.sglang import runner

    specs: list = []

    def fake(spec, *args, **kw):
        specs.append(spec)
        raise UsageError("no engine here")

    monkeypatch.setattr(runner, "SGLangRunner", fake)
    target, draft = tmp_path / "real" / "target", tmp_path / "real" / "draft"
    target.mkdir(parents=True), draft.mkdir()
    out = tmp_path / "out"
    pair = ["--model", str(target), "--draft", str(draft)]
    assert cc.main(["--out", str(out), "--cells", "DFLASH:on:mixed", *pair]) == 0
    assert cc.main(["--out", str(out), "--cells", "NONE:on:one"]) == 0
    assert [(s.model_dir, s.draft_dir, s.pair) for s in specs] == [(target, draft, "hybrid"), (None, None, "hybrid")]
    rows = json.loads((out / "capture_cost.json").read_text())
    assert [r["model"] for r in rows] == ["builtin:hybrid"]
    capsys.readouterr()
    for bad in (["--model", str(tmp_path / "missing")], ["--draft", str(draft)], ["--model", str(target), "--draft",
                                                                                  str(tmp_path / "nope")]):
        assert cc.main(["--out", str(out), "--cells", "DFLASH:on:mixed", *bad]) == 2
        err = capsys.readouterr().err
        assert "not a directory" in err or "--draft needs --model" in err, err
    assert len(specs) == 2


def test_the_batch_columns_read_the_full_books_else_the_sampled_else_the_first_captured_pass():
    """ledger_of: a --no-full cell's recorded batch is its sampled passes' (the first captured pass carries first-use
    costs), a sampled book that recorded nothing is passed over, and the plain batch is always the untraced passes'."""
    full, sampled, captured = ({"recorded_ms_per_batch": x, "recorded_batches": 5} for x in (4.1, 4.0, 6.6))
    untraced = {"plain_ms_per_batch": 2.9}
    assert rd.ledger_of({"full": full, "sampled": sampled, "captured": captured, "untraced": untraced}) == \
        {**full, "plain_ms_per_batch": 2.9}
    no_full = {"sampled": sampled, "captured": captured, "untraced": untraced}
    assert rd.ledger_of(no_full)["recorded_ms_per_batch"] == 4.0
    idle = {**sampled, "recorded_batches": 0}
    assert rd.ledger_of({"sampled": idle, "captured": captured})["recorded_ms_per_batch"] == 6.6
    assert rd.ledger_of({}, {"recorded_ms_per_batch": 7.0}) == {"recorded_ms_per_batch": 7.0,
                                                                 "plain_ms_per_batch": None}
    row = {"algorithm": "DFLASH", "graphs": True, "passes": {"untraced": [1.0] * 3, "sampled": [1.02] * 3, "full": []},
           "pass_costs": {"sampled": sampled, "captured": captured, "untraced": untraced}, "ledger": captured}
    assert rd.reread([row])[0]["ledger"]["recorded_ms_per_batch"] == 4.0


def test_a_row_reads_its_trace_passes_books_and_the_schedulers_host(tmp_path):
    """row_of on a stand-in trace: the medians, the per-round readings of wall time and of run_batch seconds, the
    target reading, and the first scheduler's host speed from the capture's status."""
    from types import SimpleNamespace as NS

    settings = {"repeat_generate_s": [1.0] * 6, "sampled_generate_s": [1.02] * 6, "full_generate_s": [1.6] * 6,
                "generate_s": 1.7, "pass_costs": {"untraced": {"run_batch_s": [0.5] * 6, "plain_ms_per_batch": 1.0},
                                                   "sampled": {"run_batch_s": [0.51] * 6}},
                "repeats_match": False, "sampled_match": False, "full_match": False,
                "round_match": {"sampled": True, "full": True}}
    host = {"clock_read_ns": 45.0, "python_loop_us": 190.0}
    trace = NS(prov=NS(settings=settings), provenance={"capture": {"status": [{"tp_rank": 0, "host": host}]}},
               steps=[object()] * 4, requests=[object()] * 2)
    (tmp_path / "t.arrow").write_bytes(b"x" * 400)
    row = cc.row_of("DFLASH", True, "mixed", trace, tmp_path / "t.arrow")
    assert row["overhead_sampled"] == pytest.approx(1.02) and row["bytes_per_step"] == 100.0
    assert row["target"] == {"full": "over", "sampled": "within"} and row["host"] == host
    assert row["per_round_run_batch"]["sampled"]["median"] == pytest.approx(1.02)
    assert row["per_round_run_batch"]["full"] is None
    # every pass left the captured one, but each captured pass gave its round's untraced tokens
    assert row["tokens_same_round"] == {"sampled": True, "full": True}
    assert "| False/False/False; True/True |" in tb.markdown([{**row, "overhead_full": 1.6}], 16)
    # a kind that left its round's untraced pass: in how many of its rounds, and the first of them
    settled = {**row, "tokens_same_round": {"sampled": False, "full": True},
               "round_mismatch": {"sampled": [0, 2, 3, 5], "full": []}}
    assert "| False/False/False; False (4 of 6 rounds: 0,2,3…)/True |" in tb.markdown([settled], 16)


def test_pooled_rows_lay_one_cells_rounds_end_to_end_and_recompute_what_depends_on_them():
    """Two runs of DFLASH on, mixed (three rounds each: no interval alone) pool into one row of six rounds with an
    interval; its medians come from the pooled passes, its books are left out; another cell stays its own row."""
    def row(alg: str, sampled: list[float], untraced: list[float]) -> dict:
        return {"algorithm": alg, "graphs": True, "workload": "mixed", "overhead_sampled": 9.0, "booked": {"x": 1},
                "passes": {"untraced": untraced, "sampled": sampled, "full": []},
                "pass_costs": {"untraced": {"run_batch_s": [0.5] * 3}, "sampled": {"run_batch_s": [0.52] * 3}}}

    rows = [row("DFLASH", [1.1, 1.2, 1.3], [1.0, 1.0, 1.0]), row("NGRAM", [2.0] * 3, [2.0] * 3),
            row("DFLASH", [2.2, 2.4, 2.6], [2.0, 2.0, 2.0])]
    got = rd.pooled(rows)
    assert [(r["algorithm"], r["pooled_runs"]) for r in got] == [("DFLASH", 2), ("NGRAM", 1)]
    dflash = got[0]
    assert dflash["passes"]["sampled"] == [1.1, 1.2, 1.3, 2.2, 2.4, 2.6] and dflash["booked"] == {}
    assert dflash["overhead_sampled"] == pytest.approx(1.75 / 1.5)  # median pass over median untraced pass
    assert dflash["per_round"]["sampled"]["rounds"] == 6 and dflash["per_round"]["sampled"]["ci95"] == (1.1, 1.3)
    assert dflash["per_round_run_batch"]["sampled"]["median"] == pytest.approx(1.04)
    assert rd.per_round(rows[0]["passes"]["sampled"], rows[0]["passes"]["untraced"])["ci95"] is None
    # the round checks: the second run's differing rounds follow the first run's three
    rows[0].update(tokens_same_round={"sampled": False}, round_mismatch={"sampled": [0]})
    rows[2].update(tokens_same_round={"sampled": False}, round_mismatch={"sampled": [0, 1, 2]})
    rows[1].update(tokens_same_round={"sampled": True}, round_mismatch={"sampled": []})
    got = rd.pooled(rows)
    assert got[0]["round_mismatch"] == {"sampled": [0, 3, 4, 5]} and got[0]["tokens_same_round"] == {"sampled": False}
    assert got[1]["round_mismatch"] == {"sampled": []} and got[1]["tokens_same_round"] == {"sampled": True}
    assert tb._round(got[0]) == "; False (4 of 6 rounds: 0,3,4…)/—"


def test_the_unrecorded_batches_books_pool_weighted_by_batches_and_show_the_pass_over():
    """An unrecorded decode batch's ms in the untraced and the sampled passes, and the hooks' pass-over of it: one
    run's as booked, two runs' as means weighted by their batches; the column says untraced / sampled (pass-over),
    and the plain batches right after a recorded one where the books hold them (``next``)."""
    def row(plain_u: float, plain_s: float, passed: float, batches: int) -> dict:
        return {"algorithm": "DFLASH", "graphs": True, "workload": "mixed",
                "passes": {"untraced": [1.0] * 3, "sampled": [1.0] * 3, "full": []},
                "pass_costs": {"untraced": {"run_batch_s": [], "plain_batches": batches, "plain_ms_per_batch": plain_u},
                               "sampled": {"run_batch_s": [], "plain_batches": batches, "plain_ms_per_batch": plain_s,
                                           "passed_ms_per_plain_batch": passed}}}

    assert tb._unrecorded(row(3.6, 3.8, 0.05, 10)["pass_costs"]) == "3.60 / 3.80 (0.050)"
    pooled = rd.pooled([row(3.0, 3.3, 0.04, 10), row(4.0, 4.2, 0.07, 30)])[0]["pass_costs"]
    assert pooled["untraced"]["plain_ms_per_batch"] == pytest.approx(3.75)
    assert pooled["sampled"]["plain_ms_per_batch"] == pytest.approx(3.975)
    assert pooled["sampled"]["passed_ms_per_plain_batch"] == pytest.approx(0.0625)
    assert pooled["sampled"]["plain_batches"] == 40 and tb._unrecorded({}) == "— / — (—)"
    after = row(3.0, 3.3, 0.04, 10)
    after["pass_costs"]["sampled"].update(next_batches=2, next_ms_per_batch=4.0)
    assert tb._unrecorded(after["pass_costs"]) == "3.00 / 3.30 (0.040; next 4.00)"
    more = row(3.0, 3.3, 0.04, 10)
    more["pass_costs"]["sampled"].update(next_batches=6, next_ms_per_batch=5.0)
    pooled = rd.pooled([after, more, row(4.0, 4.2, 0.07, 30)])[0]["pass_costs"]["sampled"]
    assert pooled["next_ms_per_batch"] == pytest.approx(4.75) and pooled["next_batches"] == 8


def test_until_is_shared_equally_among_the_cells_left_after_what_each_engine_costs_besides_its_rounds():
    """share_until: the time left less each remaining engine's fixed cost, split equally among the cells, the next
    engine's cells taking theirs after its own fixed cost; never past --until; no --until, no end. fixed_cost: an
    engine's wall time less its cells' passes'."""
    assert cc.share_until(None, 0.0, 150.0, 3, 3) is None
    assert cc.share_until(1000.0, 0.0, 150.0, 4, 4) == 250.0  # (1000 - 4 * 150) / 4 after its own 150 s
    assert cc.share_until(1000.0, 0.0, 150.0, 1, 1) == 1000.0
    assert cc.share_until(1000.0, 900.0, 150.0, 2, 2) == 1000.0  # too little left: rounds up to --until at most
    # two engines left, three cells: the next engine's two cells take two thirds of (1000 - 2 * 150)
    assert cc.share_until(1000.0, 0.0, 150.0, 2, 3, 2) == pytest.approx(150.0 + 700.0 * 2 / 3)
    assert cc.fixed_cost([{"passes": {"untraced": [1.0, 2.0], "full": [3.0]}}], 10.0) == 4.0
    assert cc.fixed_cost([{"passes": {"untraced": [1.0]}}, {"passes": {"full": [2.0]}}], 10.0) == 7.0
    assert cc.fixed_cost([{"error": "UsageError: no engine"}], 7.5) == 7.5


def test_every_cell_gets_rounds_under_until_and_a_row_is_written_before_its_diff(tmp_path, monkeypatch):
    """Three cells under --until 700, each starting in 100 s and timing rounds up to the end it is given: the
    first's end assumes FIXED_S per cell, the later ones the 100 s measured, and each gets a third of the rounds'
    time. With --diff, a cell's timing row is in capture_cost.json before its trace is judged (a call killed while
    judging keeps it)."""
    clock = [0.0]
    ends: list[float] = []

    def fake_cell(args, algorithm, graphs, loads, until):
        end = 1e9 + 250.0 if until is None else until  # no --until: rounds of a set length
        ends.append(end - 1e9)
        clock[0] += 100.0  # the engine's start
        rounds = max(end - 1e9 - clock[0], 0.0)
        clock[0] += rounds
        return [({"algorithm": algorithm, "graphs": graphs, "workload": load, "passes": {"untraced": [rounds]},
                  "error": "a stand-in row (the table prints it as an error)"}, object(), None) for load in loads]

    monkeypatch.setattr(cc, "run_engine", fake_cell)
    monkeypatch.setattr(cc.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(cc.time, "time", lambda: 1e9 + clock[0])
    cells = "DFLASH:on:mixed,NGRAM:on:mixed,NONE:on:mixed"
    assert cc.main(["--out", str(tmp_path), "--cells", cells, "--until", "700"]) == 0
    first = cc.FIXED_S + (700 - 3 * cc.FIXED_S) / 3
    assert ends[0] == pytest.approx(first)
    assert ends[1] == pytest.approx(first + 100 + (700 - first - 200) / 2)
    assert ends[2] == pytest.approx(700.0)
    rounds = [r["passes"]["untraced"][0] for r in json.loads((tmp_path / "capture_cost.json").read_text())]
    assert min(rounds) > 100 and rounds[1] == pytest.approx(rounds[2])

    def killed(args, row, trace, capture):
        assert json.loads((tmp_path / "d" / "capture_cost.json").read_text())[-1]["algorithm"] == row["algorithm"]
        raise KeyboardInterrupt  # the call's time limit, while judging

    monkeypatch.setattr(cc, "diffed", killed)
    with pytest.raises(KeyboardInterrupt):
        cc.main(["--out", str(tmp_path / "d"), "--cells", "DFLASH:on:mixed", "--diff"])
    assert json.loads((tmp_path / "d" / "capture_cost.json").read_text())[0]["passes"]


def test_a_cells_result_json_alone_rereads_as_its_timing_row(tmp_path, capsys):
    """--reread of OUT/CELL/result.json (a cell whose trace was never read): the cell from its directory's name, the
    model from its job.json, the per-round reading from its passes, the trace's columns shown as not read; a result
    without passes or a directory that names no cell is exit 2."""
    settings = {"repeat_generate_s": [1.0] * 6, "sampled_generate_s": [1.02] * 6, "full_generate_s": [1.6] * 6,
                "generate_s": 1.7, "repeats_match": True, "sampled_match": True, "full_match": True}
    cell = tmp_path / "refcheck_ddtree-eager-one"
    cell.mkdir()
    (cell / "result.json").write_text(json.dumps(settings))
    (cell / "job.json").write_text(json.dumps({"engine_kwargs": {"model_path": "/tmp/real/target"}}))
    row = cc.result_row(cell / "result.json")
    assert (row["algorithm"], row["graphs"], row["workload"], row["model"]) == ("REFCHECK_DDTREE", False, "one",
                                                                                "/tmp/real/target")
    assert row["target"] == {"full": "over", "sampled": "within"} and row["trace_read"] is False
    assert cc.main(["--reread", str(cell / "result.json")]) == 0
    line = capsys.readouterr().out.strip().splitlines()[2]
    assert line.startswith("| REFCHECK_DDTREE | off | one | — (trace not read) | 1.000 ") and "| ≤1.3: over / " in line
    part = tmp_path / "refcheck_ddtree-eager-mixed"  # a later workload on the same engine: its job names the first's
    part.mkdir()
    (part / "result.json").write_text(json.dumps(settings))
    (part / "job.json").write_text(json.dumps({"engine_job": str(cell / "job.json")}))
    assert cc.result_row(part / "result.json")["model"] == "/tmp/real/target"
    (part / "job.json").write_text(json.dumps({"engine_job": "/elsewhere/refcheck_ddtree-eager-one/job.json"}))
    assert cc.result_row(part / "result.json")["model"] == "/tmp/real/target"  # copied here: its sibling's job
    (cell / "result.json").write_text(json.dumps({"stage": "start"}))
    assert cc.main(["--reread", str(cell / "result.json")]) == 2
    assert "not an engine run's result.json" in capsys.readouterr().err
    other = tmp_path / "records"
    other.mkdir()
    (other / "result.json").write_text(json.dumps(settings))
    assert cc.main(["--reread", str(other / "result.json")]) == 2
    assert "is not a cell's directory" in capsys.readouterr().err


def test_neighbouring_cells_of_one_engine_share_it_a_workload_each_in_their_own_directories(tmp_path, monkeypatch):
    """engines(): cells of one algorithm and CUDA graphs next to each other run on one engine (--engine-per-cell: one
    each); run_engine asks the runner for both workloads' traces, the first cell's directory the engine's, the
    second's its part's, and each row names the engine it ran on."""
    from types import SimpleNamespace as NS

    from refcheck.sglang import runner
    from refcheck.trace import io

    todo = cc.cells(_args(cells="DFLASH:on:one,DFLASH:on:mixed,DFLASH:off:mixed,NGRAM:off:mixed,NGRAM:off:one"))
    # the heaviest workload first, whatever the cells' order
    assert cc.engines(todo) == [("DFLASH", True, ["mixed", "one"]), ("DFLASH", False, ["mixed"]),
                                ("NGRAM", False, ["mixed", "one"])]
    assert len(cc.engines(todo, per_cell=True)) == 5
    assert cc.engines([("NONE", True, "one"), ("NONE", True, "one")]) == [("NONE", True, ["one"]), ("NONE", True, ["one"])]
    asked: list = []

    class Fake:
        def __init__(self, spec, algorithm, **kw):
            self.kw, self.last_capture = kw, None

        def traces(self, workloads, part_dirs):
            asked.append((self.kw["capture_dir"], part_dirs, [len(w) for w in workloads]))
            settings = {"repeat_generate_s": [1.0] * 3, "generate_s": 1.0}
            return [NS(prov=NS(settings=settings), provenance={"capture": {}}, steps=[object()] * 2,
                       requests=[object()] * len(w)) for w in workloads]

    monkeypatch.setattr(runner, "SGLangRunner", Fake)
    monkeypatch.setattr(io, "write_trace", lambda trace, path: path.write_bytes(b"x" * 10))
    monkeypatch.setattr(io, "fixed_bytes", lambda trace: 4)
    assert cc.main(["--out", str(tmp_path), "--cells", "NGRAM:on:one,NGRAM:on:mixed"]) == 0
    assert asked == [(tmp_path / "ngram-graphs-mixed", [tmp_path / "ngram-graphs-one"], [32, 1])]
    rows = json.loads((tmp_path / "capture_cost.json").read_text())
    assert [(r["workload"], r["engine"], r["requests"]) for r in rows] == [("mixed", "ngram-graphs-mixed", 32),
                                                                           ("one", "ngram-graphs-mixed", 1)]
    # 10 bytes over 2 steps; the steps alone: the file less its 4 fixed bytes
    assert [(r["bytes_per_step"], r["step_bytes_per_step"]) for r in rows] == [(5.0, 3.0), (5.0, 3.0)]
    assert "| 5 (3) |" in (tmp_path / "capture_cost.md").read_text()
    assert cc.main(["--out", str(tmp_path / "b"), "--cells", "NGRAM:on:one,NGRAM:on:mixed", "--engine-per-cell"]) == 0
    assert [len(a[2]) for a in asked[1:]] == [1, 1]


def test_the_diffs_steps_per_second_leave_the_references_load_out(monkeypatch):
    """judge(): the pool loads the trace's reference first (timed apart, diff_load_s), then the diff is timed alone:
    4 steps judged in 2 s are 2 steps/s, whatever the 5 s load took."""
    from types import SimpleNamespace as NS

    from refcheck.diff import judge as judge_module

    clock = [0.0]
    loads: list = []

    class Pool:
        def runner_for(self, trace, case, dtype, device):
            loads.append((case, dtype))
            clock[0] += 5.0

    def fake_judge(trace, pool, name, mode, ref_device):
        clock[0] += 2.0
        return NS(verdict="pass", failures=[])

    monkeypatch.setattr(cc, "_pool", lambda: Pool())
    monkeypatch.setattr(judge_module, "judge", fake_judge)
    monkeypatch.setattr(cc.time, "perf_counter", lambda: clock[0])
    got = cc.judge(NS(steps=[object()] * 4), "dflash-graphs-one")
    assert got["diff_steps_per_s"] == 2.0 and got["diff_load_s"] == 5.0 and got["verdict"] == "pass"
    assert loads == [("dflash-graphs-one", "float32")]


def test_diff_workloads_judge_only_the_cells_of_those_workloads_and_refuse_another(tmp_path, monkeypatch, capsys):
    """--diff --diff-workloads one: of an engine's two cells only the one-request cell's trace is judged (a real-width
    32-request trace takes minutes to judge); a workload that does not exist is exit 2 before any engine starts."""
    judged: list[str] = []

    def fake_engine(args, algorithm, graphs, loads, until):
        return [({"algorithm": algorithm, "graphs": graphs, "workload": load, "passes": {"untraced": [1.0]},
                  "error": "a stand-in row"}, object(), None) for load in loads]

    def fake_diffed(args, row, trace, capture):
        judged.append(row["workload"])
        return {"verdict": "pass"}

    monkeypatch.setattr(cc, "run_engine", fake_engine)
    monkeypatch.setattr(cc, "diffed", fake_diffed)
    cells = "DFLASH:on:mixed,DFLASH:on:one"
    assert cc.main(["--out", str(tmp_path), "--cells", cells, "--diff", "--diff-workloads", "one"]) == 0
    assert judged == ["one"]
    assert cc.main(["--out", str(tmp_path), "--cells", cells, "--diff"]) == 0
    assert judged == ["one", "mixed", "one"]
    monkeypatch.setattr(cc, "run_engine", lambda *a: pytest.fail("an engine started"))
    assert cc.main(["--out", str(tmp_path), "--cells", cells, "--diff", "--diff-workloads", "one,many"]) == 2
    assert "--diff-workloads: many is no workload (choose from one, mixed)" in capsys.readouterr().err


def test_the_table_names_the_caches_whose_device_work_ran_eagerly():
    """The ledger's column: graphs replayed and run eagerly per recorded batch, and which caches ran eagerly (none
    named where none did, or where the ledger has no counts by cache)."""
    ledger = {"plain_ms_per_batch": 12.84, "recorded_ms_per_batch": 19.56, "hooks_ms_per_batch": 1.71,
              "graph_replays_per_batch": 3.25, "graph_eager_per_batch": 0.75}
    row = {"algorithm": "DFLASH", "graphs": True, "workload": "mixed", "untraced_s": 1.0, "overhead_full": 1.4,
           "overhead_sampled": 1.0, "tokens_same_untraced": True, "tokens_same_sampled": True}
    by_cache = {"state": 0.0, "verify": 0.75, "draft": 0.0, "context": 0.0}
    tables = [tb.markdown([{**row, "ledger": {**ledger, **extra}}], 16)
              for extra in ({"graph_eager_by_cache": by_cache}, {"graph_eager_by_cache": dict.fromkeys(by_cache, 0.0)},
                            {})]
    assert "| 12.84 / 19.56 (1.71; graphs 3.25 replayed / 0.75 eager (verify 0.75)) |" in tables[0]
    assert "(1.71; graphs 3.25 replayed / 0.75 eager) |" in tables[1] and tables[1] == tables[2]
