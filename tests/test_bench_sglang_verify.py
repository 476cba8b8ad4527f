"""scripts/bench_sglang_verify.py on CPU: the dry run's Qwen3.6-27B-shaped config (the widths of
bench_verify's shape, read as a hybrid target by refcheck and laid out as SGLang derives it), the
SGLang engine arguments per budget, the timing plugin's bookkeeping with stand-in CUDA events, the
per-step figures and ratios computed from a child's result, the parent / child plumbing end to end
against a stand-in ``sglang`` module (one child process per budget, the retry without overlap), and
the reference phase through bench_verify's functions at its small shape on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from script_loader import load_script

from refcheck.errors import UsageError
from refcheck.sglang.pair import is_hybrid_target


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_sglang_verify")  # puts scripts/ on sys.path: the sides' modules import by name


@pytest.fixture(scope="module")
def timing(bench):
    import bench_sglang_timing

    return bench_sglang_timing


@pytest.fixture(scope="module")
def engine(bench):
    import bench_sglang_engine

    return bench_sglang_engine


def test_dry_run_writes_a_27b_config_and_dummy_weight_engine_arguments(bench, tmp_path, capsys):
    model, plan = tmp_path / "model", tmp_path / "plan.json"
    assert bench.main(["--dry-run", "--model-dir", str(model), "--out", str(plan)]) == 0
    cfg = json.loads((model / "config.json").read_text())
    shape = bench.load_bench_verify().SHAPES["qwen3.6-27b"]
    assert {k: cfg[k] for k in shape} == shape  # every width the reference's benchmark builds
    assert cfg["architectures"] == ["Qwen3_5ForCausalLM"] and cfg["model_type"] == "qwen3_5_text"
    assert cfg["linear_conv_kernel_dim"] == 4 and cfg["tie_word_embeddings"] is False
    assert is_hybrid_target(model)
    types = cfg["layer_types"]
    assert len(types) == 64 and types.count("linear_attention") == 48
    # SGLang (configs/qwen3_next.py layers_block_type) places full attention where (layer + 1) % interval == 0
    interval = cfg["full_attention_interval"]
    assert ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(64)] == types
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"] and cfg["partial_rotary_factor"] == 0.25
    out = json.loads(plan.read_text())
    for b in (15, 64):
        kw = out["engine_kwargs"][str(b)]
        assert kw["load_format"] == "dummy" and kw["model_path"] == str(model)
        assert kw["speculative_algorithm"] == "NGRAM" and kw["speculative_num_draft_tokens"] == b + 1
        assert kw["disable_cuda_graph"] is False and kw["cuda_graph_max_bs_decode"] == 1
        assert kw["max_running_requests"] == 1 and kw["page_size"] == 1 and kw["disable_radix_cache"]
        assert kw["attention_backend"] == kw["linear_attn_backend"] == "triton" and kw["dtype"] == "bfloat16"
        assert kw["speculative_ngram_max_bfs_breadth"] > 1  # a tree layout (breadth 1 runs the chain layout)
    assert out["ref_prefix"] == 512 + 256 // 2 and out["sglang"] == {} and out["reference"] == {}
    text = capsys.readouterr().out
    assert text.startswith("dry run: config") and '"load_format": "dummy"' in text


def test_engine_kwargs_follow_the_options_and_refuse_trees_sglang_cannot_verify(bench, tmp_path):
    kw = bench.engine_kwargs(tmp_path, 7, mem_fraction=0.5, overlap=False, ngram_breadth=4)
    assert kw["speculative_num_draft_tokens"] == 8 and kw["mem_fraction_static"] == 0.5
    assert kw["disable_overlap_schedule"] is True and kw["speculative_ngram_max_bfs_breadth"] == 4
    assert bench.engine_kwargs(tmp_path, 15)["disable_overlap_schedule"] is False  # SGLang's default
    for bad in (0, 1024):  # at most 1024 tree tokens (refcheck.sglang.runner.MAX_TREE_TOKENS)
        with pytest.raises(UsageError, match="budget"):
            bench.engine_kwargs(tmp_path, bad)


def test_prompt_is_repetitive_and_inside_the_vocabulary(bench):
    p = bench.make_prompt(512, 248320)
    assert len(p) == 512 and max(p) < 248320 and p[:48] == p[48:96] and len(set(p)) > 1
    assert bench.make_prompt(640, 248320)[:512] == p  # the reference's longer prefix starts the same


class FakeEvent:
    def __init__(self, clock: list[float]) -> None:
        self.clock, self.at, self.done = clock, None, True

    def record(self) -> None:
        self.at = self.clock[0]

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: FakeEvent) -> float:
        return end.at - self.at


class Mode:
    def __init__(self, verify: bool) -> None:
        self.verify = verify

    def is_target_verify(self) -> bool:
        return self.verify

    def is_decode(self) -> bool:
        return not self.verify


class Batch:
    def __init__(self, verify: bool) -> None:
        self.forward_mode = Mode(verify)


class Out:
    can_run_graph = True


def test_timing_plugin_times_verify_forwards_only_and_writes_finished_spans(timing, tmp_path, monkeypatch):
    clock = [0.0]
    made: list[FakeEvent] = []

    def event() -> FakeEvent:
        made.append(FakeEvent(clock))
        return made[-1]

    times = tmp_path / "times.jsonl"
    monkeypatch.setattr(timing, "_times_path", str(times))
    monkeypatch.setattr(timing, "_new_event", event)
    monkeypatch.setattr(timing, "_capturing", lambda: False)
    monkeypatch.setattr(timing, "_pending", [])

    def forward(runner, batch):
        clock[0] += 2.5
        return Out()

    def lines() -> list[tuple]:
        return [(r["kind"], r["ms"], r["graphed"]) for r in map(json.loads, times.read_text().splitlines())]

    assert isinstance(timing._verify_forward_hook(forward, None, Batch(verify=True)), Out)
    assert len(made) == 2 and not times.exists()  # pending until a later hook finds its end event done
    timing._verify_forward_hook(forward, None, Batch(verify=False))  # a prompt's forward: not timed, flushes
    assert len(made) == 2 and lines() == [("verify_forward", 2.5, True)]
    timing._spec_step_hook(forward, None, Batch(verify=False))  # a decode-mode batch: one NGRAM step
    made[3].done = False  # still running on the GPU
    timing.flush_times()
    assert len(lines()) == 1 and len(timing._pending) == 1
    made[3].done = True
    timing.flush_times()
    assert lines()[1] == ("spec_step", 2.5, None) and timing._pending == []
    monkeypatch.setattr(timing, "_capturing", lambda: True)  # inside SGLang's graph capture: no events
    timing._verify_forward_hook(forward, None, Batch(verify=True))
    assert len(made) == 4


def test_spans_go_to_the_timed_pass_whose_window_holds_them(timing, tmp_path):
    times = tmp_path / "t.jsonl"
    lines = [("verify_forward", 1.0, 30.0, True), ("verify_forward", 5.0, 20.0, True), ("spec_step", 5.1, 25.0, None),
             ("verify_forward", 6.0, 21.0, False), ("verify_forward", 9.0, 99.0, True)]
    times.write_text("".join(json.dumps({"kind": k, "t": t, "ms": ms, "graphed": g}) + "\n" for k, t, ms, g in lines))
    got = timing.attribute_times(times, {"timed-0": (4.0, 7.0)})
    assert got == {"timed-0": {"verify_forward": [20.0, 21.0], "spec_step": [25.0], "graphed": [True, False]}}


def test_summary_and_ratios_from_a_child_result(bench, engine):
    timed = [{"rid": f"timed-{k}", "wall_s": 2.1, "spec_verify_ct": 50, "completion_tokens": 256,
              "spec_accept_length": 5.12} for k in range(3)]
    res = {"timed": timed, "prefill_only": [{"wall_s": 0.1}, {"wall_s": 0.1}],
           "forward_times": {p["rid"]: {"verify_forward": [30.0, 32.0], "spec_step": [36.0], "graphed": [True, True]}
                             for p in timed}}
    s = engine.summarise_sglang(res)
    assert s["step_ms"] == pytest.approx(40.0) and s["step_ms_raw"] == pytest.approx(42.0)
    assert s["verify_forward"]["median_ms"] == 31.0 and s["verify_forward"]["n"] == 6
    assert s["verify_graphed"] == "6 of 6" and s["tokens_per_s"] == pytest.approx(256 / 2.1)
    reference = {"floor_ms": 13.0, "budgets": {"15": {"compiled_graphed": {"median_ms": 24.8},
                                                       "graphed": {"median_ms": 31.0}}}}
    rows = bench.combine({"15": {"summary": s}}, reference, [15, 64])
    assert rows[0]["ratio_ref_over_sglang_forward"] == pytest.approx(0.8)
    assert rows[0]["ratio_ref_over_sglang_step"] == pytest.approx(0.62)
    assert rows[0]["reference_x_floor"] == pytest.approx(24.8 / 13.0)
    assert rows[1]["sglang_step_ms"] is None and rows[1]["ratio_ref_over_sglang_forward"] is None
    assert engine.summarise_sglang({"timed": []}) == {}
    g = bench.goal(rows)  # B=15 measured on both sides (0.8x: met), B=64 not
    assert g["per_budget"] == {"15": True, "64": None} and g["met"] is None
    assert "B=15 met (0.80×); B=64 not measured" in bench.goal_line(g, rows)
    slow = [dict(rows[0], ratio_ref_over_sglang_forward=1.24)]
    assert bench.goal(slow)["met"] is False and "B=15 NOT met (1.24×)" in bench.goal_line(bench.goal(slow), slow)


FAKE_SGLANG = '''
import json, os, time

__version__ = "0.0-fake"


class Engine:
    def __init__(self, **kwargs):
        if os.environ.get("FAKE_START_FAIL"):
            raise RuntimeError("Not enough memory. Please try to increase --mem-fraction-static.")
        self.draft = kwargs["speculative_num_draft_tokens"]

    def generate(self, input_ids, sampling_params, rid):
        assert isinstance(input_ids[0], int) and isinstance(rid, str)
        n = sampling_params["max_new_tokens"]
        steps = n // 2  # every verify step commits two tokens; the prefill gives the first
        with open(os.environ["BENCH_SGLANG_VERIFY_TIMES"], "a") as f:  # what the scheduler's plugin writes
            for _ in range(steps):
                time.sleep(0.002)
                f.write(json.dumps({"kind": "verify_forward", "t": time.time(), "ms": float(self.draft),
                                    "graphed": True}) + "\\n")
        meta = {"completion_tokens": n, "spec_verify_ct": steps} if steps else {"completion_tokens": n}
        return {"output_ids": [7] * n, "meta_info": meta}

    def shutdown(self):
        pass
'''


def test_sglang_phases_run_in_a_child_and_report_per_step_figures(bench, tmp_path, monkeypatch):
    (tmp_path / "fake" / "sglang").mkdir(parents=True)
    (tmp_path / "fake" / "sglang" / "__init__.py").write_text(FAKE_SGLANG)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    out = tmp_path / "res" / "bench.json"
    argv = ["--phases", "sglang", "--budgets", "3,5", "--max-new-tokens", "16", "--sglang-reps", "2",
            "--min-sglang-s", "1", "--model-dir", str(tmp_path / "m"), "--out", str(out)]
    assert bench.main(argv) == 1  # no reference phase: not complete
    res = json.loads(out.read_text())
    for b in (3, 5):
        phase = res["sglang"][str(b)]
        assert phase["stage"] == "done" and phase["rc"] == 0 and phase["sglang"] == "0.0-fake", phase
        assert [p["rid"] for p in phase["timed"]] == ["timed-0", "timed-1"] and len(phase["prefill_only"]) == 2
        s = phase["summary"]
        assert s["verify_steps"] == [8, 8] and s["verify_graphed"] == "16 of 16"
        assert s["verify_forward"]["median_ms"] == b + 1  # only the timed passes' spans, not the warm pass's
        assert 0 < s["step_ms"] < s["step_ms_raw"]
        assert Path(phase["log"]).parent == out.parent
    assert res["budgets"][0]["sglang_verify_forward_ms"] == 4 and res["budgets"][0]["reference_verify_ms"] is None
    monkeypatch.setenv("FAKE_START_FAIL", "1")
    assert bench.main(argv[:3] + ["3"] + argv[4:]) == 1
    res = json.loads(out.read_text())
    phase = res["sglang"]["3"]
    assert phase["stage"] == "failed" and phase["failed_at"] == "start" and "mem-fraction" in phase["error"]
    assert phase["summary"] == {} and phase["first_attempt"]["failed_at"] == "start"  # tried again without overlap
    assert res["overlap"] is False and res["engine_kwargs"]["3"]["disable_overlap_schedule"] is True


def test_reference_phase_times_the_exact_tree_chunk_through_bench_verify(bench, tmp_path):
    out = tmp_path / "ref.json"  # the small shape on CPU: graph capture's eager stand-in, the compiled rows skipped
    argv = ["--phases", "reference", "--ref-shape", "small", "--ref-device", "cpu", "--budgets", "3", "--reps", "1",
            "--prompt-len", "24", "--max-new-tokens", "8", "--compile-reserve", "1e9", "--model-dir",
            str(tmp_path / "m"), "--out", str(out)]
    assert bench.main(argv) == 1  # no SGLang phase: not complete
    res = json.loads(out.read_text())
    ref = res["reference"]
    assert ref["prefix"] == 28 and ref["floor_ms"] > 0 and ref["weight_gb"] > 0
    assert ref["budgets"]["3"]["graphed"]["n"] == 1 and ref["budgets"]["3"]["tree_tokens"] == 4
    assert res["skipped"] == ["compiled rows (time limit)"] and res["budgets"][0]["reference_verify_ms"] is None
