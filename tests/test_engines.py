"""The engine table (refcheck/engines.py): every --engine name resolves to one kind, unknown names and
options a kind does not take are refused with what exists, and the reference and fault engines trace
through the one interface (a fault engine's trace differs from the reference's where the fault acts)."""

from __future__ import annotations

import pytest

from refcheck.engines import KINDS, check_engine, kind_of, open_engine
from refcheck.errors import UsageError
from refcheck.prompts import load_prompts
from refcheck.reference_runner import EngineSpec


@pytest.mark.parametrize("name, kind", [("reference", "reference"), ("fault:sibling-leak", "fault"),
                                        ("fault:rec-scale:0.01", "fault"), ("zlab", "zlab"), ("sglang", "sglang"),
                                        ("sglang:REFCHECK_DDTREE", "sglang")])
def test_every_engine_name_has_one_kind(name, kind):
    assert kind_of(name).name == kind


@pytest.mark.parametrize("name", ["vllm", "fault", "fault:", "sglang:", "reference:x", "zlab:x", ""])
def test_an_unknown_engine_lists_the_engines(name):
    with pytest.raises(UsageError, match=r"unknown engine .*live engines: reference, fault:NAME, zlab, sglang"):
        kind_of(name)


def test_an_unknown_fault_is_refused_with_the_faults():
    with pytest.raises(UsageError, match="fault:sibling-leak"):
        check_engine("fault:nope")


def test_options_only_where_the_kind_takes_them():
    assert check_engine("sglang:NGRAM", {"cuda_graphs": True, "ngram_breadth": 3}).name == "sglang"
    with pytest.raises(UsageError, match=r"engine zlab takes no tp option \(only sglang\[:ALGORITHM\] does\)"):
        check_engine("zlab", {"tp": 2})
    assert [k.name for k in KINDS if k.dtype] == ["sglang"]  # SGLang alone runs in its own dtype unless told


def test_reference_and_fault_engines_trace_through_one_interface():
    spec = EngineSpec(pair="hybrid", drafter="scripted", budget=4, max_new_tokens=6)
    prompts = load_prompts()[:1]
    ref = open_engine("reference", spec).trace(prompts)
    bad = open_engine("fault:sibling-leak", spec).trace(prompts)
    assert ref.provenance["engine"]["name"] == "reference" and bad.provenance["engine"]["name"] == "fault:sibling-leak"
    assert [s.step for s in ref.steps] and [s.step for s in bad.steps]
    assert [s.topk_logprobs for s in ref.steps] != [s.topk_logprobs for s in bad.steps]


def test_adding_an_engine_is_one_module_and_one_registry_entry(monkeypatch, cli):
    """tests/stub_engine.py and one EngineKind row: `refcheck diff --engine stub` then runs it through the
    same path as every engine (option checks, the diff, the verdict and its exit code), a correct one
    passes and one that drops a token fails at the output."""
    from stub_engine import open_stub

    import refcheck.engines as engines
    from refcheck.engines import EngineKind
    from refcheck.errors import EXIT_MISMATCH, EXIT_PASS, EXIT_USAGE

    row = EngineKind("stub", "stub[:drop]", "the reference's run reported as another engine's (tests/stub_engine.py)",
                     frozenset(), None, None, open_stub)
    monkeypatch.setattr(engines, "KINDS", (*engines.KINDS, row))
    args = ("diff", "--engine", "stub", "--budget", "4", "--max-new-tokens", "6", "--mode", "free")
    code, _, err = cli(*args)
    assert code == EXIT_PASS, err
    code, _, err = cli(*args[:2], "stub:drop", *args[3:])
    assert code == EXIT_MISMATCH and "output" in err
    code, _, err = cli(*args, "--sglang-settings", "graphs")  # an option the kind does not take: refused as for any
    assert code == EXIT_USAGE and "engine stub takes no settings option" in err
