"""`golden regen`'s review shows library-version and numeric drift, not only token changes."""

from __future__ import annotations

import copy
import json

import torch

from refcheck import provenance
from refcheck.errors import EXIT_GOLDEN, EXIT_PASS, EXIT_USAGE
from refcheck.goldens import GOLDEN_CASES, REPO_GOLDEN, GoldenCase
from refcheck.goldens.drift import numeric_drift, version_changes
from refcheck.goldens.review import review
from refcheck.trace.io import read_trace


def golden_trace():
    return read_trace(REPO_GOLDEN / "hybrid-b1.arrow")


def test_a_golden_against_itself_is_unchanged():
    old = golden_trace()
    rev = review("hybrid-b1", old, golden_trace())
    assert rev.status == "unchanged" and rev.version_changes == []
    assert rev.drift.steps_compared == len(old.steps) and not rev.drift.any
    assert rev.drift.summary() == f"identical over {len(old.steps)} steps"


def test_versions_log_probs_and_state_that_moved_are_shown():
    old, new = golden_trace(), golden_trace()
    new.provenance = copy.deepcopy(new.provenance)
    new.provenance["versions"]["transformers"] = "9.9.9"
    new.steps[3].topk_logprobs[1][0] += 0.01
    rec = next(e for e in new.steps[5].state if e.kind == "rec")
    rec.sketch = rec.sketch * 1.001
    rev = review("hybrid-b1", old, new)
    assert rev.status == "drifted"  # same tokens and acceptance; the bytes still change
    assert rev.version_changes == [f"transformers {old.provenance['versions']['transformers']} → 9.9.9"]
    assert abs(rev.drift.max_logprob_abs - 0.01) < 1e-5
    assert abs(rev.drift.max_state_rel_l2["rec"] - 1e-3) < 1e-6
    assert "|Δ log-prob| ≤ 0.01" in rev.drift.summary() and "(rec)" in rev.drift.summary()
    assert rev.to_json()["numeric_drift"]["max_state_rel_l2"]["rec"] > 0


def test_a_moved_topk_id_is_counted_not_compared():
    old, new = golden_trace(), golden_trace()
    row = new.steps[0].topk_ids[0]
    row[0], row[1] = row[1], row[0]
    d = numeric_drift(old, new)
    assert d.topk_ids_moved == 2 and d.any


def test_version_changes_lists_only_what_differs():
    assert version_changes({"versions": {"torch": "2.13", "transformers": "5.23.0"}},
                           {"versions": {"torch": "2.13", "transformers": "5.24.0", "numpy": "2"}}) == \
        ["transformers 5.23.0 → 5.24.0", "numpy - → 2"]


def test_regen_of_an_unchanged_case_is_unchanged_and_a_version_bump_is_drift(cli, monkeypatch, tmp_path):
    gdir = tmp_path / "golden"
    monkeypatch.setitem(GOLDEN_CASES, "tiny", GoldenCase("tiny", "hybrid", 4, max_new_tokens=4))
    assert cli("golden", "regen", "--case", "tiny", "--golden", str(gdir), "--accept")[0] == EXIT_PASS
    code, out, _ = cli("golden", "regen", "--case", "tiny", "--golden", str(gdir), "--json")
    assert code == EXIT_GOLDEN and json.loads(out)["reviews"][0]["status"] == "unchanged"
    real = provenance.library_versions

    monkeypatch.setattr(provenance, "library_versions", lambda: {**real(), "transformers": "0.0.1"})
    code, out, err = cli("golden", "regen", "--case", "tiny", "--golden", str(gdir), "--json")
    rev = json.loads(out)["reviews"][0]
    assert code == EXIT_GOLDEN and rev["status"] == "drifted"
    assert rev["version_changes"][0].endswith("→ 0.0.1") and "transformers" in err
    # drift changes the bytes: replacing the golden needs a reason like any change
    code, _, err = cli("golden", "regen", "--case", "tiny", "--golden", str(gdir), "--accept")
    assert code == EXIT_USAGE and "--reason" in err
    assert torch.is_tensor(read_trace(gdir / "tiny.arrow").steps[0].state[0].sketch)
