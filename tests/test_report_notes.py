"""Human report output: every count explained, no ``None``, the explain hint on the finding the table shows,
manifest rules named."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from refcheck.cli.app import err
from refcheck.cli.diff import explain_hint, golden_note
from refcheck.cli.notes import WHY_NOT_COMPARED, count_notes, explain_target, headline, where
from refcheck.cli.reports import report_table
from refcheck.diff.findings import Finding, Report, Verdict
from refcheck.goldens import default_golden_dir
from refcheck.goldens.judge import entry_rules
from refcheck.goldens.manifest import golden_entry_for
from refcheck.goldens.policy import GatePolicy

ROOT = Path(__file__).resolve().parents[1]


def report(*findings: Finding, checks: int = 100) -> Report:
    r = Report("case-x", "both", findings=list(findings), checks=Counter({"logits": checks}))
    return r


def printed(fn, *args) -> str:
    with err.capture() as cap:
        fn(*args)
    return cap.get()


def test_where_never_prints_none():
    assert where(Finding(Verdict.FAIL, "ar_tokens", "code-1", None, position=50, details={"index": 35})) == \
        "code-1 (whole request, output token 35) · ar_tokens"
    assert where(Finding(Verdict.FAIL, "output", "code-1", -1)) == "code-1 prefill · output"
    assert where(Finding(Verdict.FAIL, "tree", "a", 3)) == "a step 3 · tree"
    assert where({"request_id": "a", "step": 0, "node": 5, "category": "recurrent", "layer": 0,
                  "layer_type": "linear_attention"}) == "a step 0 node 5 · recurrent · layer 0 (linear_attention)"


def test_table_shows_the_node_the_explain_hint_names():
    late = Finding(Verdict.FAIL, "logits", "arith-2", 21, node=9, message="off")
    early = Finding(Verdict.FAIL, "logits", "prose-2", 20, node=9, message="off")
    r = report(late, early)
    assert headline(r) is early and explain_target(r) is early
    table = printed(report_table, [r], "t")
    assert "prose-2 step 20 node 9 · logits" in table and "+1 more request failing" in table
    hint = printed(explain_hint, r, "T.arrow")
    assert "--request prose-2 --step 20 --node 9" in hint and "is not a node-level" not in hint


def test_hint_says_when_the_table_shows_another_kind_of_finding():
    kv = Finding(Verdict.FAIL, "kv", "a", 1, message="kv off")
    node = Finding(Verdict.FAIL, "logits", "b", 4, node=2, message="off")
    r = report(kv, node)
    assert headline(r) is kv and explain_target(r) is node
    hint = printed(explain_hint, r, "T.arrow")
    assert "--request b --step 4 --node 2" in hint and "the table's a step 1 · kv is not a node-level logits finding" in hint


def test_request_level_failures_print_no_none():
    r = report(Finding(Verdict.FAIL, "ar_tokens", "code-1", None, position=50, details={"index": 35}, message="differs"),
               Finding(Verdict.SKIPPED, "output", "code-2", None, message="request has no output and no steps"))
    out = printed(report_table, [r], "t")
    assert "None" not in out
    assert "code-1 (whole request, output token 35) · ar_tokens" in out
    assert "1 skipped · output: the engine produced nothing for this request; at code-2 (whole request)" in out


def test_every_count_is_explained_with_places():
    fs = [Finding(Verdict.UNSUPPORTED, "draft", "a", s, message="engine recorded no draft top-k") for s in range(6)]
    fs += [Finding(Verdict.UNSUPPORTED, c, "a", 0, message="engine recorded no state") for c in ("kv", "conv")]
    fs += [Finding(Verdict.TRIAGED, "logits", "b", 3, node=7, details={"rule": "rounding"}, message="within"),
           Finding(Verdict.TRIAGED, "logits", "b", 4, node=1, details={"triaged_by": "manifest"}, message="x"),
           Finding(Verdict.BENIGN_TIE, "logits", "c", 2, node=4, message="tie")]
    r = report(*fs)
    lines = count_notes(r)
    text = "\n".join(lines)
    assert "6 unsupported · draft: the engine's trace carries no drafter top-k" in text
    assert "at a step 0, a step 1, a step 2, a step 3 and 2 more" in text
    assert "2 unsupported · kv, conv (1 each): the engine's trace carries no KV" in text
    assert "1 triaged · logits: within what rounding at the engine's dtype moves that node" in text and "b step 3 node 7" in text
    assert "1 triaged · logits: reviewed by a person and listed in the golden's manifest" in text and "b step 4 node 1" in text
    assert "1 benign tie(s) · logits:" in text and "c step 2 node 4" in text
    assert lines[-1].endswith("--steps (one row per verify step) or --json (every finding)")
    # each non-pass count of the table is covered by a note: the numbers add up
    counted = sum(int(re.match(r"case-x: (\d+) ", ln).group(1)) for ln in lines[:-1])
    c = r.counts
    assert counted == c["unsupported"] + c["skipped"] + c["triaged"] + c["benign_tie"]


def test_every_unsupported_or_skipped_message_in_the_diff_has_an_explanation():
    messages = set()
    for path in (ROOT / "refcheck" / "diff").glob("*.py"):
        src = path.read_text()
        for m in re.finditer(r"Verdict\.(?:UNSUPPORTED|SKIPPED)[^\n]*?(?:\n[^\n]*?)?message=\"([^\"]+)\"", src):
            messages.add(m.group(1))
    assert messages, "the pattern found no unsupported/skipped findings: update this test"
    assert messages <= set(WHY_NOT_COMPARED), messages - set(WHY_NOT_COMPARED)


def test_manifest_rules_that_changed_a_verdict_are_named():
    triaged = [Finding(Verdict.TRIAGED, "logits", "prose-1", 1, node=10)]
    policy = GatePolicy.of("x", {"expect": "fail:logits",
                                 "expect_first": {"request_id": "code-1", "step": 0, "node": 6, "layer": 3}})
    rules = policy.rules_applied({"draft": 219}, triaged)
    assert rules[0].startswith("allow_unsupported draft: 219 draft check(s)")
    assert rules[1] == "triaged: 1 reviewed failure(s) reported as triaged, not failed: prose-1 step 1 node 10 logits"
    assert "passes only when refcheck finds a logits failure, first at code-1 step 0 node 6 layer 3" in rules[2]
    r = report()
    r.stats["manifest_rules"] = rules
    out = printed(report_table, [r], "t")
    assert "case-x: manifest: allow_unsupported draft" in out


def test_diff_of_a_golden_file_names_its_manifest_entry():
    gdir = default_golden_dir()
    name, entry = golden_entry_for(gdir / "zlab-hybrid-chain.arrow")
    assert name == "zlab-hybrid-chain"
    assert entry_rules(entry)[0].startswith("expect fail:logits")
    out = printed(golden_note, gdir / "zlab-hybrid-chain.arrow", False)
    assert "refcheck gate judges it through its manifest entry, which this diff does not apply" in out
    assert "allow_unsupported kv,conv,recurrent" in out
    assert golden_entry_for(ROOT / "README.md") is None


def test_trace_show_prints_one_readable_fact_a_line(cli):
    code, _, out = cli("trace", "show", str(default_golden_dir() / "sglang-hybrid-ngram-b11.arrow"))
    assert code == 0 and "{" not in out and "None" not in out
    assert "engine: sglang 0.5.17 · algorithm NGRAM" in out and "no draft model" in out
    assert "requests: 6 (code-1, code-2, arith-1, arith-2, prose-1, prose-2) · verify steps: 219 · mean τ 1.785" in out
    assert "recorded with: refcheck 0.1.0, torch 2.11.0+cu130, transformers 5.12.1" in out


def test_the_goldens_page_lists_every_fault_engine():
    """docs/goldens.md's fault:NAME table names every discrete fault and the graded ones' stems, nothing else."""
    from refcheck.selftest.faults import fault_names

    readme = (ROOT / "docs" / "goldens.md").read_text()
    table = readme[readme.index("| NAME | what the engine gets wrong |"):]
    table = table[:table.index("\n\n")]
    listed = {m.group(1) for m in re.finditer(r"^\| `([a-z0-9:.\-A-Z]+)` \|", table, re.M)}
    want = {n.split(":")[0] + (":EPS" if ":" in n else "") for n in fault_names()}
    assert listed == want


def test_an_expected_failure_row_shows_the_request_its_manifest_checks():
    other = Finding(Verdict.FAIL, "logits", "arith-2", 0, node=7, message="m")
    checked = Finding(Verdict.FAIL, "logits", "code-1", 0, node=6, layer=3, message="m")
    r = report(other, checked)
    r.expect_failure, r.expect_first = "fail:logits", {"request_id": "code-1", "step": 0, "node": 6, "layer": 3}
    assert headline(r) is checked
    assert "expected failure caught" in printed(report_table, [r], "t") and "code-1 step 0 node 6" in printed(report_table, [r], "t")


def test_the_goldens_diff_notes_only_entries_with_rules():
    gdir = default_golden_dir()
    assert printed(golden_note, gdir / "hybrid-b15.arrow", True) == ""
    out = printed(golden_note, gdir / "zlab-hybrid-chain.arrow", True)
    assert out.startswith("note: golden zlab-hybrid-chain: its reviewed findings were applied here")
    assert "expect fail:logits; allow_unsupported kv,conv,recurrent" in out


def test_golden_add_and_sglang_sweep_name_places_without_none():
    from refcheck.diff.place import where as place
    from refcheck.sglang.sweep import _first

    step_level = Finding(Verdict.FAIL, "tree", "code-1", 0, message="m")
    assert place(step_level) == "code-1 step 0 · tree"
    assert _first(report(step_level)) == "code-1 step 0 · tree"
