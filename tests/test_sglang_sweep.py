"""The SGLang sweep (refcheck/sglang/sweep.py, ``refcheck sweep --engine sglang``): its rows from recorded or saved
traces, and at temperature 1."""

from __future__ import annotations

import pytest

from refcheck.errors import EXIT_USAGE, UsageError
from refcheck.reference_runner import EngineSpec


def test_sglang_sweep_table_from_recorded_traces(tmp_path):
    """The sweep's bookkeeping over stand-in runs: the stored SGLang goldens play the engine."""
    from refcheck.goldens import REPO_GOLDEN
    from refcheck.goldens.manifest import load_manifest
    from refcheck.prompts import load_prompts
    from refcheck.sglang.sweep import run_sglang_sweep
    from refcheck.trace.io import read_trace

    cases = load_manifest(REPO_GOLDEN).cases
    traces = {"GOOD": read_trace(REPO_GOLDEN / cases["sglang-hybrid-ngram-b11"].file),
              "LEAKY": read_trace(REPO_GOLDEN / cases["sglang-hybrid-ngram-b11-breadth1-leak"].file)}

    class Replayed:
        def __init__(self, spec, alg, timing_repeats=0, **options):
            self.alg, self.repeats = alg, timing_repeats
            seen.append(options)

        def trace(self, prompts):
            t = traces[self.alg]
            t.provenance["engine"]["settings"].update(generate_s=2.0, repeat_generate_s=[0.5, 1.0, 0.25][: self.repeats],
                                                      repeats_match=self.alg == "GOOD")
            return t

    seen: list[dict] = []
    res = run_sglang_sweep(EngineSpec(pair="hybrid", dtype="bfloat16"), load_prompts(), [11], repeats=3,
                           algorithms=("GOOD", "LEAKY"), ref_device="cpu", runner_factory=Replayed, save_dir=tmp_path,
                           runner_options={"mem_fraction": 0.15, "cuda_graphs": True})
    assert seen == [{"mem_fraction": 0.15, "cuda_graphs": True}] * 2  # every engine gets the sweep's options
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{a}-b11.arrow" for a in ("GOOD", "LEAKY")]
    good, leaky = res["rows"]
    assert good["verdict"] == "pass" and good["fail_categories"] == []  # its 3 deviating nodes judged bf16 rounding
    assert leaky["verdict"] == "fail" and "recurrent" in leaky["fail_categories"]
    assert leaky["first_divergence"].split(" · ")[1] == "logits" and "step 0" in leaky["first_divergence"]
    emitted = sum(len(r.output_ids) for r in traces["GOOD"].requests)
    assert good["cold_tokens_per_s"]["median"] == emitted / 2.0  # the captured run
    assert good["tokens_per_s"] == {"median": emitted / 0.5, "min": emitted / 1.0, "max": emitted / 0.25}  # warm repeats
    assert good["repeats_match"] is True and leaky["repeats_match"] is False
    assert abs(good["mean_tau"] - 1.785) < 1e-3 and good["steps"] == 219


def test_sglang_sweep_from_saved_traces_groups_by_algorithm_and_budget(tmp_path):
    """`sweep --engine sglang --from-traces`: the same rows from saved traces, no engine; bad input refused."""
    from click.testing import CliRunner

    from refcheck.cli import main
    from refcheck.goldens import REPO_GOLDEN
    from refcheck.goldens.manifest import load_manifest
    from refcheck.sglang.sweep import tabulate_traces
    from refcheck.trace.io import read_trace

    cases = load_manifest(REPO_GOLDEN).cases
    good = read_trace(REPO_GOLDEN / cases["sglang-hybrid-ngram-b11"].file)
    leaky = read_trace(REPO_GOLDEN / cases["sglang-hybrid-ngram-b11-breadth1-leak"].file)
    res = tabulate_traces([leaky, good, good], ref_device="cpu")
    rows = {r["algorithm"]: r for r in res["rows"]}
    assert set(rows) == {"NGRAM breadth 1", "NGRAM breadth 10"} and res["repeats"] == 2
    assert rows["NGRAM breadth 10"]["verdict"] == "pass"  # by default: its 3 deviating nodes judged rounding
    assert rows["NGRAM breadth 1"]["verdict"] == "fail" and "recurrent" in rows["NGRAM breadth 1"]["fail_categories"]
    # where the leak lands in the carried state: the first GDN layer's recurrent state
    assert rows["NGRAM breadth 1"]["first_state_failure"].endswith("recurrent layer 0")
    assert rows["NGRAM breadth 10"]["first_state_failure"] == ""
    assert rows["NGRAM breadth 10"]["steps"] == 219 and rows["NGRAM breadth 10"]["budget"] == 11
    reference_trace = read_trace(REPO_GOLDEN / cases["hybrid-b15"].file)
    with pytest.raises(UsageError, match="not an SGLang trace"):
        tabulate_traces([reference_trace])
    out = CliRunner().invoke(main, ["sweep", "--from-traces", str(REPO_GOLDEN / cases["hybrid-b15"].file)])
    assert out.exit_code != 0 and "--engine sglang" in str(out.exception or out.output)


def test_sglang_sweep_at_temperature_one(tmp_path, cli):
    """`sweep --engine sglang --temperature 1`: the runner gets the sampling (no refusal before it), the row is the
    sampled replay's verdict, and SGLang-generator repeats are not held to the captured tokens."""
    import copy

    from ddtree_reference.sampling import Sampling
    from refcheck.prompts import load_prompts
    from refcheck.reference_runner import ReferenceRunner
    from refcheck.sglang.sweep import run_sglang_sweep, sweep_row
    from refcheck.trace.io import Trace

    s = Sampling(temperature=1.0, seed=1)
    # a short sampled run of the reference plays the engine (keyed draws, replayed exactly)
    keyed, _ = ReferenceRunner(EngineSpec(pair="hybrid", budget=15, max_new_tokens=6, sampling=s)).trace(load_prompts()[:1])
    keyed.provenance["engine"]["settings"].update(generate_s=1.0, repeat_generate_s=[0.5], repeats_match=False)
    seen = []

    class Replayed:
        def __init__(self, spec, alg, timing_repeats=0):
            seen.append(spec.sampling)

        def trace(self, prompts):
            return keyed

    res = run_sglang_sweep(EngineSpec(pair="hybrid", dtype="bfloat16", sampling=s), load_prompts(), [15],
                           algorithms=("REFCHECK_DDTREE",), ref_device="cpu", runner_factory=Replayed)
    assert seen == [s] and res["temperature"] == 1.0 and res["seed"] == 1
    row = res["rows"][0]
    assert row["verdict"] == "pass" and row["repeats_match"] is False  # keyed draws must repeat: a mismatch shows

    class Same:  # the same report stands in for an NGRAM row: only the repeats bookkeeping differs
        verdict, counts, failures, stats = row["verdict"], row["counts"], [], {}

        @staticmethod
        def first_divergence():
            return {}

    engine_rng = copy.deepcopy(keyed.provenance)
    engine_rng["engine"]["settings"]["rng"] = "engine"
    assert sweep_row("NGRAM", 11, [Trace(engine_rng, keyed.requests, keyed.steps)], Same())["repeats_match"] is None
    code, _, err = cli("sweep", "--engine", "sglang", "--temperature", "1", "--budgets", "15", "--out", str(tmp_path / "o"))
    assert code == EXIT_USAGE and "cannot sample" not in err  # refused only for want of a GPU or SGLang
