"""Typed provenance (refcheck/provenance.py: Provenance.of): every stored golden reads back typed; a
missing key means what old traces meant; a field of the wrong type is a corrupt trace (exit 4), not a
traceback or a silently different diff."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from refcheck.errors import EXIT_CORRUPT
from refcheck.goldens import REPO_GOLDEN
from refcheck.goldens.manifest import load_manifest
from refcheck.provenance import Provenance, ProvenanceError
from refcheck.trace.io import read_trace, write_trace


def _golden(name: str):
    return read_trace(REPO_GOLDEN / load_manifest(REPO_GOLDEN).cases[name].file)


def test_every_golden_reads_typed():
    for name, entry in load_manifest(REPO_GOLDEN).cases.items():
        prov = read_trace(REPO_GOLDEN / entry.file).prov
        assert prov.engine in ("reference", "zlab", "sglang"), name
        assert prov.budget is None or prov.budget >= 0
        assert (prov.capture is not None) == (prov.engine == "sglang"), name  # SGLang's capture reports itself
        assert prov.tree_rules == ("structural" if prov.engine == "sglang" else "exact"), name


def test_what_a_missing_key_means():
    p = Provenance.of({})
    assert (p.engine, p.dtype, p.device, p.budget, p.drafter, p.max_new_tokens) == ("?", "float32", "cpu", 15, "dflash", 64)
    assert p.tree_rules == "exact" and p.capture is None and p.stop_token_ids == frozenset() and p.seed == 0
    assert Provenance.of({"budget": "chain"}).budget is None


@pytest.mark.parametrize("where, value, match", [
    (("budget",), "abc", "provenance budget"),
    (("dtype",), 16, "provenance dtype is int"),
    (("engine", "settings", "tree_rules"), "loose", "tree_rules is 'loose'"),
    (("engine", "settings", "seed"), "7", "engine.settings.seed is str"),
    (("capture",), ["x"], "provenance capture is list"),
    (("engine",), "sglang", "provenance engine is str"),
])
def test_a_field_of_the_wrong_type_is_refused(where, value, match):
    d = copy.deepcopy(_golden("sglang-hybrid-none").provenance)
    node = d
    for k in where[:-1]:
        node = node[k]
    node[where[-1]] = value
    with pytest.raises(ProvenanceError, match=match):
        Provenance.of(d)


def test_a_trace_with_a_bad_provenance_field_is_corrupt_on_the_cli(cli, tmp_path: Path):
    trace = _golden("sglang-hybrid-none")
    trace.provenance["engine"]["settings"]["tree_rules"] = 3
    write_trace(trace, tmp_path / "t.arrow")
    code, out, err = cli("diff", "--against", str(tmp_path / "t.arrow"), "--mode", "replay")
    assert code == EXIT_CORRUPT and "tree_rules is int" in err and "Traceback" not in err + out
