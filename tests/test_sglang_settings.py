"""Production settings of an SGLang run (refcheck/sglang/settings.py) and what the runner, the
engine process and the capture do with them, without a GPU: parsing and its refusals, the engine
arguments, the up-front refusals of settings SGLang or refcheck's algorithm cannot run, the context
check, staggered arrivals through the engine process, and committed lengths taken from the device."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from refcheck.errors import EXIT_USAGE, UsageError
from refcheck.reference_runner import EngineSpec
from refcheck.sglang.pair import check_context
from refcheck.sglang.runner import SGLangRunner, engine_kwargs
from refcheck.sglang.settings import DEFAULT, PAGE_SIZES, ServingSettings, parse_settings


def test_default_is_refchecks_safest_corner():
    kw = DEFAULT.engine_kwargs()
    assert kw == {"disable_overlap_schedule": True, "disable_radix_cache": True, "disable_cuda_graph": True,
                  "page_size": 1}
    assert DEFAULT.label() == "default" and parse_settings("") == parse_settings("default") == DEFAULT


def test_every_setting_reaches_the_engine_arguments():
    s = parse_settings("graphs, overlap,radix,page=16,chunk=1024,running=8,stagger=25")
    assert s == ServingSettings(True, True, True, 16, 1024, 8, 25)
    kw = engine_kwargs(EngineSpec(dtype="bfloat16"), "/m", "NGRAM", budget=11, settings=s)
    assert (kw["disable_overlap_schedule"], kw["disable_radix_cache"], kw["disable_cuda_graph"]) == (False, False, False)
    assert (kw["page_size"], kw["chunked_prefill_size"], kw["max_running_requests"]) == (16, 1024, 8)
    assert "stagger_ms" not in kw  # arrivals are the engine process's, not an engine argument


@given(st.builds(ServingSettings, st.booleans(), st.booleans(), st.booleans(), st.sampled_from(PAGE_SIZES),
                 st.one_of(st.none(), st.integers(16, 1 << 16)), st.one_of(st.none(), st.integers(1, 512)),
                 st.integers(0, 10_000)))
def test_label_parses_back_to_the_same_settings(s):
    assert parse_settings(s.label()) == s


@pytest.mark.parametrize("text, message", [
    ("bogus", "unknown SGLang setting 'bogus'"), ("page=3", "powers of two"), ("page=x", "needs an integer"),
    ("overlap=1", "takes no value"), ("chunk=8", "must be >= 16"), ("stagger=-1", "must be >= 0")])
def test_bad_settings_are_usage_errors_naming_the_item(text, message):
    with pytest.raises(UsageError, match=message):
        parse_settings(text)


def test_cli_refuses_bad_settings_and_settings_for_other_engines(cli):
    code, _, err = cli("diff", "--engine", "sglang", "--sglang-settings", "overlap,bogus")
    assert code == EXIT_USAGE and "unknown SGLang setting 'bogus'" in err
    code, _, err = cli("diff", "--engine", "reference", "--sglang-settings", "overlap")
    assert code == EXIT_USAGE and "settings" in err


@pytest.mark.parametrize("algorithm, settings, breadth, message", [
    ("REFCHECK_DDTREE", "overlap", 10, "runs synchronously"),
    ("NGRAM", "page=16", 10, "paged tree attention is only supported on flashinfer"),
    ("DFLASH", "radix,page=16", 10, "radix cache needs page size 1"),
    ("DFLASH", "radix,overlap", 10, "turns the overlap scheduler off"),
    ("NONE", "graphs,overlap,radix,page=16", 10, "radix with overlap and page=16"),
])
def test_settings_the_engine_cannot_run_are_refused_before_it_starts(algorithm, settings, breadth, message):
    with pytest.raises(UsageError, match=message):
        SGLangRunner(EngineSpec(pair="hybrid", dtype="bfloat16", budget=15 if algorithm != "NGRAM" else 11), algorithm,
                     settings=parse_settings(settings), ngram_breadth=breadth)


def test_settings_the_engine_can_run_get_past_the_refusals(monkeypatch):
    import torch

    from refcheck.sglang.runner import EngineUnavailableError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for alg, budget, s, breadth in (("NGRAM", 11, "page=16", 1), ("DFLASH", 15, "overlap,page=64,graphs", 10),
                                    ("DFLASH", 15, "radix,graphs,stagger=5", 10), ("REFCHECK_DDTREE", 15, "page=16,graphs", 10),
                                    ("REFCHECK_DDTREE", 15, "radix,graphs", 10)):
        with pytest.raises(EngineUnavailableError):  # past every refusal, to the missing GPU
            SGLangRunner(EngineSpec(pair="hybrid", dtype="bfloat16", budget=budget), alg, settings=parse_settings(s),
                         ngram_breadth=breadth)


def test_a_prompt_beyond_the_targets_context_is_refused(tmp_path):
    from refcheck.models import builtin_pair
    from refcheck.models.context import extend_context
    from refcheck.prompts import Prompt

    long = [Prompt("long", tuple([5] * 2040), max_new_tokens=16)]
    with pytest.raises(UsageError, match="exceed the target's context of 2048"):
        check_context(long, EngineSpec(), builtin_pair()[0])
    target, draft = extend_context(*builtin_pair(), tmp_path / "long", 32768)
    check_context(long, EngineSpec(), target)  # the long-context copy holds it
    assert (target / "model.safetensors").read_bytes() == (builtin_pair()[0] / "model.safetensors").read_bytes()
    with pytest.raises(UsageError, match="does not shrink"):
        extend_context(target, draft, tmp_path / "short", 1024)


def test_cli_exits_2_for_a_prompt_longer_than_the_context(cli, tmp_path):
    import json

    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"id": "long", "prompt_ids": [5] * 2100}) + "\n")
    code, _, err = cli("run", "--prompts", str(f))
    assert code == EXIT_USAGE and "context" in err


def test_staggered_arrivals_run_through_the_engine_process(monkeypatch, tmp_path):
    """stagger=MS: the engine process submits request i at i * MS ms (async_generate on SGLang's loop), and the
    warm-up pass runs untraced first; outputs come back in prompt order."""
    import sys
    from pathlib import Path

    import torch

    from refcheck.prompts import load_prompts

    fake = str(Path(__file__).parent / "fake_sglang")
    monkeypatch.syspath_prepend(fake)
    monkeypatch.setenv("PYTHONPATH", fake)
    monkeypatch.setenv("FAKE_SGLANG_MODE", "ok")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sys, "path", list(sys.path))
    prompts = load_prompts()[:3]
    runner = SGLangRunner(EngineSpec(dtype="bfloat16", device="cuda", max_new_tokens=2), "NONE", capture=False,
                          capture_dir=tmp_path, settings=parse_settings("stagger=150"), warmup=True, timing_repeats=1)
    trace = runner.trace(prompts)
    assert [r.output_ids for r in trace.requests] == [[p.prompt_ids[-1]] * 2 for p in prompts]
    st_ = trace.provenance["engine"]["settings"]
    assert st_["serving_label"] == "stagger=150" and st_["warmup_match"] is True and st_["repeats_match"] is True
    assert st_["generate_s"] >= 0.3  # the third request arrived 2 x 150 ms after the first
    import json

    job = json.loads((tmp_path / "job.json").read_text())
    assert job["stagger_s"] == 0.15 and len(job["warmup_rids"]) == 3


def test_committed_lengths_come_from_the_device_where_the_batch_has_them():
    """Under the overlap scheduler the scheduler's request lists lag one step behind the device: the capture
    takes the forward batch's seq lens, and says how far the lists lagged."""
    import torch

    from refcheck.sglang.capture.expand import _committed, _lags

    rec = {"committed_host": [10, 20], "t": {}}
    assert _committed(rec) == ([10, 20], {"committed_from": "requests"})
    got, meta = _committed({**rec, "t": {"committed": torch.tensor([13, 20])}})
    assert got == [13, 20] and meta == {"committed_from": "forward_batch", "committed_lag": 3}
    assert _committed({**rec, "t": {"committed": torch.tensor([1])}})[1]["committed_from"] == "requests"  # another size
    assert _lags([], []) == 0


def test_the_hybrid_radix_cache_is_refused_where_sglang_would_run_something_else():
    """SGLang 0.5.17 resolves a hybrid target's radix cache at start-up: no mamba extra buffer for the
    architecture -> page size 1 asserted and overlap silently off; an extra buffer -> state in ping-pong
    slots the capture does not read. Either way the run asked for is not the run captured: refused, saying
    which. Radix alone, or overlap / pages without radix, or an attention-only target, pass."""
    from refcheck.sglang.settings import radix_refusal

    assert "needs page size 1" in radix_refusal(parse_settings("radix,page=64"), "Qwen3_5ForCausalLM", True)
    assert "turns the overlap scheduler off" in radix_refusal(parse_settings("radix,overlap"), "Qwen3_5ForCausalLM", True)
    assert "extra buffer" in radix_refusal(parse_settings("radix,overlap"), "Qwen3_5ForConditionalGeneration", True)
    for ok, hybrid in (("radix", True), ("overlap,page=16", True), ("radix,overlap,page=16", False)):
        assert radix_refusal(parse_settings(ok), "Qwen3_5ForCausalLM", hybrid) is None


def test_a_setting_sglang_changed_at_start_up_is_a_capture_error():
    """The plugin records how each scheduler actually serves; anything that differs from what was asked makes
    the trace's capture fail, by name (a release that does not say is not held against the run)."""
    from refcheck.sglang.runner import settings_changed

    asked = parse_settings("overlap,page=16")
    assert settings_changed(asked, {"tp_rank": 0, "serving": {"overlap": True, "page_size": 16, "radix_cache": False,
                                                              "cuda_graphs": False}}) == []
    got = settings_changed(asked, {"tp_rank": 1, "serving": {"overlap": False, "page_size": 16, "radix_cache": None}})
    assert len(got) == 1 and "rank 1" in got[0] and "overlap = False although True" in got[0]
    assert settings_changed(asked, {"tp_rank": 0}) == []


def test_how_a_scheduler_serves_reads_the_cuda_graph_backends_sglang_resolved():
    """0.5.17 folds its per-phase flags, JSON config and start-up changes into ``server_args.cuda_graph_config``;
    ``disable_cuda_graph`` is only its legacy input, read where a release has no config."""
    from types import SimpleNamespace as NS

    from refcheck.sglang.capture.versions import serving_of

    def served(args):
        return serving_of(NS(server_args=args))

    cfg = NS(decode=NS(backend="disabled"), prefill=NS(backend="breakable"))
    got = served(NS(cuda_graph_config=cfg, disable_cuda_graph=False))  # --disable-decode-cuda-graph: legacy says on
    assert got["cuda_graphs"] is False and got["cuda_graph_backends"] == {"decode": "disabled", "prefill": "breakable"}
    assert served(NS(cuda_graph_config=NS(decode=NS(backend="full"), prefill=None)))["cuda_graphs"] is True
    assert served(NS(disable_cuda_graph=True))["cuda_graphs"] is False
    assert served(NS(disable_cuda_graph=False))["cuda_graphs"] is True
    assert served(NS())["cuda_graphs"] is None

