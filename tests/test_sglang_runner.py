"""The SGLang runner's CPU-testable parts: engine arguments, budgets, plugin discovery, the engine's environment,
refusals before any engine starts.

The engine's process (passes, workloads, failures) is tested in test_sglang_engine_process.py, the sweep over
engines in test_sglang_sweep.py; the capture path against a reference-built fake SGLang in test_sglang_capture.py;
the live engine runs on the GPU machine only (tests marked ``sglang`` in tests/test_gpu_sglang_*.py).
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
from pathlib import Path

import pytest

from refcheck.errors import EXIT_USAGE, UsageError
from refcheck.models import builtin_pair
from refcheck.reference_runner import EngineSpec
from refcheck.sglang.capture import versions
from refcheck.sglang.pair import draft_block_size, resolve_budget
from refcheck.sglang.runner import (
    PLUGIN_ENTRY,
    EngineUnavailableError,
    SGLangRunner,
    engine_kwargs,
    install_entry_point,
)


def test_engine_kwargs_for_clean_diffs():
    kw = engine_kwargs(EngineSpec(dtype="bfloat16"), "/m")
    assert kw["skip_tokenizer_init"] and kw["attention_backend"] == "triton" and kw["disable_radix_cache"]
    assert kw["disable_overlap_schedule"] and kw["disable_cuda_graph"] and kw["page_size"] == 1
    assert "speculative_algorithm" not in kw and "base_gpu_id" not in kw
    dfl = engine_kwargs(EngineSpec(dtype="bfloat16", device="cuda:1"), "/m", "DFLASH", cuda_graphs=True, budget=15,
                        draft_path="/d")
    assert dfl["disable_cuda_graph"] is False and dfl["speculative_draft_model_path"] == "/d"
    assert dfl["base_gpu_id"] == 1 and dfl["linear_attn_backend"] == "triton"
    ng = engine_kwargs(EngineSpec(dtype="bfloat16"), "/m", "NGRAM", budget=11, ngram_breadth=1)
    assert ng["speculative_num_draft_tokens"] == 12 and ng["speculative_ngram_max_bfs_breadth"] == 1
    tp = engine_kwargs(EngineSpec(dtype="bfloat16", device="cuda:1"), "/m", "DFLASH", budget=15, draft_path="/d", tp=2)
    assert tp["tp_size"] == 2 and tp["base_gpu_id"] == 2  # data-parallel worker 1 of TP-2 engines: GPUs 2, 3
    custom = engine_kwargs(EngineSpec(dtype="bfloat16"), "/m", "MYTREE", budget=31, draft_path="/d")
    assert custom["speculative_algorithm"] == "MYTREE" and custom["speculative_num_draft_tokens"] == 32
    with pytest.raises(UsageError):
        engine_kwargs(EngineSpec(dtype="int8"), "/m")


def test_budgets_follow_the_algorithm():
    _, ddir = builtin_pair("hybrid")
    assert draft_block_size(ddir) == 16
    assert resolve_budget("NONE", 15, ddir) == 0
    assert resolve_budget("DFLASH", None, ddir) == resolve_budget("DFLASH", 15, ddir) == 15
    with pytest.raises(UsageError, match="block size 16"):
        resolve_budget("DFLASH", 64, ddir)
    with pytest.raises(UsageError, match="dflash_config"):
        resolve_budget("DFLASH", 15, None)
    assert resolve_budget("NGRAM", 7, None) == 7
    with pytest.raises(UsageError, match="--budget"):
        resolve_budget("NGRAM", None, None)


def test_entry_point_is_discoverable_and_inert_without_capture_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "")
    monkeypatch.delenv("REFCHECK_CAPTURE_DIR", raising=False)
    install_entry_point(tmp_path)
    eps = [ep for ep in importlib.metadata.entry_points(group="sglang.srt.plugins") if ep.value.startswith("refcheck.")]
    assert eps, "the plugin entry point is not visible to importlib.metadata"
    register = eps[0].load()
    register()  # no SGLang here: no model to patch, and no capture dir: no hooks
    from refcheck.sglang import plugin
    from refcheck.sglang.capture import hooks

    assert plugin._registered and not hooks._originals
    assert str(tmp_path) in __import__("os").environ["PYTHONPATH"]


def test_the_runner_declares_the_entry_point_pyproject_declares():
    """SGLang's scheduler processes load the module the runner's dist-info names; an installed refcheck loads
    pyproject.toml's: both are refcheck.sglang.plugin:register."""
    assert PLUGIN_ENTRY == "refcheck = refcheck.sglang.plugin:register"
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert '[project.entry-points."sglang.srt.plugins"]\nrefcheck = "refcheck.sglang.plugin:register"' in pyproject


def test_versions_resolve_targets_and_bindings():
    assert versions.resolve("json.decoder.JSONDecoder.decode") is __import__("json").decoder.JSONDecoder.decode
    with pytest.raises((ImportError, AttributeError)):
        versions.resolve("refcheck.no_such_module.f")
    assert set(versions.HOOK_TARGETS) == {"run_batch", "eagle_sample", "dflash", "ddtree_sample", "sample", "verify_coins"}
    assert versions.patch_models() == [] or "sglang" in sys.modules  # nothing to patch without SGLang

    class Args:
        speculative_eagle_topk = 4

    class Sched:
        server_args = Args()

    assert versions.server_topk(Sched()) == 4


def test_runner_refuses_without_gpu_or_sglang():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(EngineUnavailableError, match="CUDA GPU"):
        SGLangRunner(EngineSpec(dtype="bfloat16"), "NONE")
    with pytest.raises(UsageError, match="block size"):
        SGLangRunner(EngineSpec(dtype="bfloat16", budget=63), "DFLASH")
    with pytest.raises(UsageError, match="mem-fraction must be between 0 and 1, got 1.5"):
        SGLangRunner(EngineSpec(dtype="bfloat16"), "NONE", mem_fraction=1.5)
    assert engine_kwargs(EngineSpec(dtype="bfloat16"), "/m", "NONE", False, 0.2)["mem_fraction_static"] == 0.2


def test_cli_sglang_unavailable_is_a_clear_usage_error(cli):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code, out, err = cli("diff", "--engine", "sglang", "--sglang-algorithm", "DFLASH", "--budget", "15", "--max-new-tokens", "4")
    assert code == EXIT_USAGE and "CUDA GPU" in err and "Traceback" not in err + out
    code, _, err = cli("diff", "--engine", "reference", "--sglang-algorithm", "DFLASH")
    assert code == EXIT_USAGE and "needs --engine sglang" in err
    code, _, err = cli("diff", "--engine", "reference", "--sglang-mem-fraction", "0.2")
    assert code == EXIT_USAGE and "engine reference takes no mem_fraction option (only sglang[:ALGORITHM] does)" in err
    code, _, err = cli("diff", "--engine", "fault:sibling-leak", "--cuda-graphs", "--layer-sketches")
    assert code == EXIT_USAGE and "takes no cuda_graphs, layer_sketches option" in err


def test_a_byte_budget_reaches_the_engine_and_the_trace(fake_sglang, tmp_path, monkeypatch):
    """--capture-max-mb: the engine's environment carries the budget in bytes and the trace names it; without one,
    a budget in the parent's environment does not leak into the engine; out of range is refused before any start."""
    from refcheck.prompts import load_prompts
    from refcheck.sglang.capture.byte_budget import ENV_MAX_BYTES

    monkeypatch.setenv(ENV_MAX_BYTES, "99")
    runner = fake_sglang("ok", capture_max_mb=2)
    assert runner._engine_env(tmp_path / "records")[ENV_MAX_BYTES] == str(2 << 20)
    assert ENV_MAX_BYTES not in fake_sglang("ok")._engine_env(tmp_path / "records")
    trace = runner.trace(load_prompts()[:1])
    assert trace.provenance["capture"]["max_bytes"] == 2 << 20
    with pytest.raises(UsageError, match=r"--capture-max-mb takes 1\.\.\d+ MiB, got 0"):
        fake_sglang("ok", capture_max_mb=0)
    from refcheck.sglang.capture.byte_budget import ENV_ROLL

    monkeypatch.setenv(ENV_ROLL, "1")
    assert ENV_ROLL not in runner._engine_env(tmp_path / "records")
    rolling = fake_sglang("ok", capture_max_mb=2, capture_roll=True)
    assert rolling._engine_env(tmp_path / "records")[ENV_ROLL] == "1"
    assert rolling.trace(load_prompts()[:1]).provenance["capture"]["roll"] is True
    with pytest.raises(UsageError, match="--capture-roll rolls the records within a byte budget"):
        fake_sglang("ok", capture_roll=True)


def test_an_earlier_runs_records_in_the_capture_dir_are_never_read_as_this_runs(fake_sglang, tmp_path):
    """A capture directory used before (a matrix cell resumed after its first engine was killed) keeps that
    engine's status and records; the next run clears them instead of reading two scheduler processes."""
    from refcheck.prompts import load_prompts

    stale = tmp_path / "ok" / "records"
    stale.mkdir(parents=True)
    (stale / "status-rank0-pid1.json").write_text('{"pid": 1, "tp_rank": 0, "hooks": {}}')
    trace = fake_sglang("ok").trace(load_prompts()[:1])
    errors = trace.provenance["capture"]["errors"]
    assert not (stale / "status-rank0-pid1.json").exists()
    assert not any("scheduler processes" in e or "pid 1" in e for e in errors), errors


def test_ddtree_refusals_come_before_any_engine_starts(tmp_path):
    """REFCHECK_DDTREE's bad input is refused on the CPU side: a tree beyond SGLang's verify kernels, a
    draft that is not DFlash or not made for the target, and the leak demonstration on a target with
    no recurrent layers. Never a scheduler dying at start-up, never a silent fallback."""
    import shutil

    from refcheck.errors import ModelError
    from refcheck.models import builtin_pair

    tdir, ddir = builtin_pair("hybrid")
    atdir, addir = builtin_pair("attention")
    assert resolve_budget("REFCHECK_DDTREE", 64, ddir, tdir) == 64
    assert resolve_budget("REFCHECK_DDTREE", 1023, ddir, tdir) == 1023
    assert resolve_budget("REFCHECK_DDTREE", 15, addir, atdir) == 15  # DDTree itself runs on attention targets
    with pytest.raises(UsageError, match="at most 1024 tokens"):
        resolve_budget("REFCHECK_DDTREE", 1024, ddir, tdir)
    with pytest.raises(ModelError, match="made for a 4-layer target, this target has 6 layers"):
        resolve_budget("REFCHECK_DDTREE", 15, addir, tdir)
    with pytest.raises(UsageError, match="no linear-attention layers"):
        resolve_budget("REFCHECK_DDTREE_LEAKY_CHAIN", 15, addir, atdir)
    plain = tmp_path / "plain"
    shutil.copytree(ddir, plain)
    cfg = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "dflash_config"}))
    with pytest.raises(ModelError, match="not one"):
        resolve_budget("REFCHECK_DDTREE", 15, plain, tdir)
    wide = tmp_path / "wide"
    shutil.copytree(ddir, wide)
    (wide / "config.json").write_text(json.dumps({**cfg, "hidden_size": 96}))
    with pytest.raises(ModelError, match="hidden_size is 96, the target's 128"):
        resolve_budget("REFCHECK_DDTREE", 15, wide, tdir)


def test_float32_is_refused_where_the_release_has_no_float32_kernel(monkeypatch):
    """SGLang 0.5.17 cannot run the Qwen3.5 built-in pair in float32 (gemma_rmsnorm): a usage error up
    front, not an engine that dies mid-run; bf16, and releases with no known limit, go on to the GPU check."""
    monkeypatch.setattr(versions, "installed_version", lambda: "0.5.17")
    with pytest.raises(UsageError, match="cannot run this target in float32: sgl_kernel's gemma_rmsnorm"):
        SGLangRunner(EngineSpec(dtype="float32"), "NONE")
    assert versions.float32_refusal("0.5.23", "qwen3_5_text") is None
    assert versions.float32_refusal("0.5.17", "llama") is None
    monkeypatch.setattr(versions, "installed_version", lambda: "0.5.23")
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(EngineUnavailableError, match="CUDA GPU"):
            SGLangRunner(EngineSpec(dtype="float32"), "NONE")


def test_refchecks_ddtree_under_cuda_graphs_is_no_longer_refused(monkeypatch):
    """REFCHECK_DDTREE under SGLang's CUDA graphs died at its first decode step on the H200 (graphs captured
    without hidden states); its server-args check now raises SGLang's hidden-state ceiling, so the runner
    lets --cuda-graphs through: the CPU-side checks pass and the engine arguments ask for graphs."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(EngineUnavailableError, match="CUDA GPU"):  # past every refusal, to the missing GPU
        SGLangRunner(EngineSpec(pair="hybrid", dtype="bfloat16", budget=15), "REFCHECK_DDTREE", cuda_graphs=True)
    kw = engine_kwargs(EngineSpec(pair="hybrid", dtype="bfloat16", budget=15), "/m", "REFCHECK_DDTREE",
                       cuda_graphs=True, budget=15, draft_path="/d")
    assert kw["disable_cuda_graph"] is False and kw["speculative_num_draft_tokens"] == 16
    assert kw["disable_overlap_schedule"] is True


def test_layer_sketches_under_cuda_graphs_are_refused_up_front():
    """A graph replay runs no module hooks: per-layer sketches under --cuda-graphs would be missing or stale,
    so the runner refuses the pair before any engine starts (a usage error, naming both options)."""
    from refcheck.errors import UsageError

    with pytest.raises(UsageError, match="--layer-sketches cannot be captured under --cuda-graphs"):
        SGLangRunner(EngineSpec(pair="hybrid", dtype="bfloat16", budget=15), "REFCHECK_DDTREE", cuda_graphs=True,
                     layer_sketches=True)


def test_sampled_request_params_carry_refcheck_keys_only_for_the_keyed_sampler():
    from ddtree_reference.sampling import Sampling, request_key
    from refcheck.prompts import load_prompts
    from refcheck.sglang.requests import check_sampling, request_sampling_params, sampling_rng

    p = load_prompts()[0]
    greedy = EngineSpec(pair="hybrid", budget=15, max_new_tokens=8)
    assert request_sampling_params(p, greedy, "REFCHECK_DDTREE")["temperature"] == 0.0
    s = Sampling(0.8, top_k=0, top_p=0.9, seed=12)
    spec = EngineSpec(pair="hybrid", budget=15, max_new_tokens=8, sampling=s)
    mine = request_sampling_params(p, spec, "REFCHECK_DDTREE")
    assert (mine["temperature"], mine["top_k"], mine["top_p"]) == (0.8, -1, 0.9)  # SGLang's top-k "off" is -1
    assert mine["custom_params"] == {"refcheck_seed": 12, "refcheck_request": request_key(p.id)}
    assert "custom_params" not in request_sampling_params(p, spec, "NGRAM")
    assert sampling_rng("REFCHECK_DDTREE") == "refcheck-philox-position" and sampling_rng("NGRAM") == "engine-children-first"
    assert sampling_rng("NONE") == "engine"
    with pytest.raises(UsageError, match="cannot sample"):
        check_sampling("DFLASH", s)
    with pytest.raises(UsageError, match="position"):
        check_sampling("REFCHECK_DDTREE", Sampling(0.8, keying="node"))
    check_sampling("NGRAM", Sampling(0.8, keying="node"))  # SGLang's own generator: the keying is not its
    check_sampling("DFLASH", None)
