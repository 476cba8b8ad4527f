"""A trace's provenance is checked when it is read as typed values (refcheck/provenance.py; Trace.prov names the
trace's file) and against the target when the trace is diffed (refcheck/pool.py: check_token_limit): a
value out of range is a corrupt trace (exit 4) whose message names the file, never a crash or a usage error."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from bad_input_kit import golden_file

from refcheck.errors import CorruptTraceError
from refcheck.pool import check_token_limit
from refcheck.provenance import Provenance, ProvenanceError
from refcheck.trace import schema as trace_schema
from refcheck.trace.io import read_trace

from trace_helpers import rewrite


def _settings(**settings: object) -> dict:
    return {"engine": {"name": "zlab", "settings": settings}}


@pytest.mark.parametrize("ids, shown", [([1.5], "1.5"), (["eos"], "'eos'"), ([True], "True"), ([-1], "-1"),
                                        ([2**31], str(2**31)), ([2**63], str(2**63))])
def test_stop_token_ids_must_be_token_ids(ids: list, shown: str) -> None:
    with pytest.raises(ProvenanceError, match=rf"stop_token_ids holds {shown}, expected token ids"):
        Provenance.of(_settings(stop_token_ids=ids))
    assert Provenance.of(_settings(stop_token_ids=[0, 2, 2**31 - 1])).stop_token_ids == frozenset({0, 2, 2**31 - 1})


@pytest.mark.parametrize("value", [0, -3, True, 2.0, "64"])
def test_max_new_tokens_must_be_a_positive_integer(value: object) -> None:
    with pytest.raises(ProvenanceError, match="provenance max_new_tokens is"):
        Provenance.of({"max_new_tokens": value})
    assert Provenance.of({"max_new_tokens": 10**9}).max_new_tokens == 10**9  # the target's context bounds it
    assert Provenance.of({}).max_new_tokens == 64


def _with_provenance(tmp_path: Path, fn) -> Path:
    def meta(m: dict) -> dict:
        prov = json.loads(m[trace_schema.KEY_PROVENANCE])
        fn(prov)
        return {**m, trace_schema.KEY_PROVENANCE: json.dumps(prov).encode()}

    rewrite(golden_file(), tmp_path / "bad.arrow", meta_fn=meta)
    return tmp_path / "bad.arrow"


@pytest.mark.parametrize("edit, message", [
    (lambda p: p["engine"]["settings"].update(stop_token_ids=[1.5]), "stop_token_ids holds 1.5"),
    (lambda p: p.update(max_new_tokens=-3), "max_new_tokens is -3"),
    (lambda p: p["engine"]["settings"].update(tree_rules=3), "tree_rules is int 3"),
])
def test_a_trace_read_from_a_file_names_it_in_provenance_errors(tmp_path: Path, edit, message: str) -> None:
    trace = read_trace(_with_provenance(tmp_path, edit))
    with pytest.raises(ProvenanceError, match=rf"^{tmp_path}/bad\.arrow: provenance .*{message}"):
        _ = trace.prov.draft_rule


def test_a_token_limit_beyond_the_targets_context_is_a_corrupt_trace() -> None:
    trace = read_trace(golden_file())
    longest = max(len(r.prompt_ids) for r in trace.requests)
    check_token_limit(trace, longest + trace.prov.max_new_tokens, "t.arrow")  # exactly fits
    with pytest.raises(CorruptTraceError, match=r"^t\.arrow: provenance max_new_tokens \d+: request '[\w-]+' has a "
                                                r"prompt of \d+ tokens, .* context of \d+ positions"):
        check_token_limit(trace, longest + trace.prov.max_new_tokens - 1, "t.arrow")
    assert trace.source == str(golden_file())
    assert dataclasses.replace(trace, provenance={**trace.provenance, "max_new_tokens": 10**9}).prov.max_new_tokens == 10**9
