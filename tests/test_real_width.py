"""The real-width pair (refcheck/models/build.py ``real``, scripts/real_width.py) at a test scale on CPU:
its configs have Qwen3.6-27B's widths and z-lab's drafter shape; the builder writes a sharded pair that the
reference loads and decodes losslessly and that SGLang's pair checks accept; the same seed gives the same
bytes; the script's summary arithmetic; and the existing pairs' configs and weight layout are unchanged."""

from __future__ import annotations

import argparse
import copy
import hashlib
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from refcheck.errors import ModelError, UsageError
from refcheck.models import MODELS_DIR
from refcheck.models.build import (
    COMMON,
    REAL_TINY,
    TARGET_CONFIGS,
    _write_weights,
    build_real_pair,
    draft_config,
    real_configs,
    widths,
)
from refcheck.sglang.pair import check_ddtree_pair, resolve_budget

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"

# draft_config() of the existing pairs before the real pair was added (their goldens hash the checkpoints)
_DRAFT_BASE = dict(architectures=["DFlashDraftModel"], attention_bias=False, block_size=16, head_dim=32, hidden_size=128,
                   initializer_range=0.1, intermediate_size=192, layer_types=["full_attention"] * 2,
                   max_position_embeddings=2048, model_type="qwen3", num_attention_heads=4, num_hidden_layers=2,
                   num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True, vocab_size=512)
EXPECTED_DRAFTS = {
    "hybrid": _DRAFT_BASE | dict(num_target_layers=6, dflash_config=dict(block_size=16, mask_token_id=1, num_target_layers=6,
                                                                          target_layer_ids=[1, 3])),
    "attention": _DRAFT_BASE | dict(num_target_layers=4, dflash_config=dict(block_size=16, mask_token_id=1,
                                                                            num_target_layers=4, target_layer_ids=[1, 1])),
    "wide": _DRAFT_BASE | dict(head_dim=128, hidden_size=1024, initializer_range=0.02, intermediate_size=3072,
                               num_attention_heads=8, num_target_layers=8,
                               dflash_config=dict(block_size=16, mask_token_id=1, num_target_layers=8, target_layer_ids=[1, 5])),
}


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _target_config(name: str) -> dict:
    from transformers import AutoConfig

    spec = dict(TARGET_CONFIGS[name])
    model_type = spec.pop("model_type")
    return AutoConfig.for_model(model_type, **(COMMON | widths(name)), **spec).to_dict()


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory) -> Path:
    """The real pair at the test scale, 4 layers, the target in shards (a 200 kB limit)."""
    out = tmp_path_factory.mktemp("real-tiny")
    build_real_pair(out, layers=4, seed=0, device="cpu", overrides=REAL_TINY, shard_bytes=200_000)
    return out


# ------------------------------------------------------------------------- the existing pairs are unchanged
@pytest.mark.parametrize("pair", ["hybrid", "attention", "wide"])
def test_existing_draft_configs_are_unchanged(pair):
    assert draft_config(TARGET_CONFIGS[pair]["num_hidden_layers"], pair) == EXPECTED_DRAFTS[pair]


@pytest.mark.parametrize("pair", ["hybrid", "attention"])
def test_existing_target_configs_match_the_shipped_ones(pair):
    shipped = json.loads((MODELS_DIR / pair / "target" / "config.json").read_text())
    added = {"refcheck_training", "transformers_version", "dtype", "architectures",  # by save_target / transformers
             "full_attention_interval", "rope_theta", "partial_rotary_factor"}  # by _sglang_fields
    cfg = _target_config(pair)
    assert {k: v for k, v in shipped.items() if k not in added} == {k: cfg.get(k) for k in shipped if k not in added}


def test_the_wide_target_config_is_unchanged():
    cfg = _target_config("wide")
    assert {k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                "head_dim", "initializer_range", "vocab_size", "tie_word_embeddings",
                                "linear_num_key_heads", "linear_num_value_heads", "num_hidden_layers")} == dict(
        hidden_size=1024, intermediate_size=3072, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
        initializer_range=0.02, vocab_size=512, tie_word_embeddings=True, linear_num_key_heads=4, linear_num_value_heads=8,
        num_hidden_layers=8)


def test_one_shard_is_the_old_single_file(tmp_path):
    """The weight writer's one-shard output is byte for byte the old ``_save``'s model.safetensors."""
    gen = torch.Generator().manual_seed(0)
    state = {"a.weight": torch.randn(8, 4, generator=gen), "b.weight": torch.ones(4), "c.bias": torch.randn(3, generator=gen)}
    (tmp_path / "new").mkdir()
    assert _write_weights(tmp_path / "new", state) == [tmp_path / "new" / "model.safetensors"]
    save_file({k: v.detach().to(torch.bfloat16).contiguous() for k, v in state.items()}, str(tmp_path / "old.safetensors"),
              metadata={"format": "pt"})
    assert (tmp_path / "new" / "model.safetensors").read_bytes() == (tmp_path / "old.safetensors").read_bytes()


# ------------------------------------------------------------------------------------------ the real pair
def test_real_configs_have_qwen36_27b_widths_and_zlab_drafter_shape():
    bench = _load_script("bench_verify").SHAPES["qwen3.6-27b"]
    fields, draft = real_configs(8)
    assert {k: fields[k] for k in bench if k != "num_hidden_layers"} == {k: v for k, v in bench.items()
                                                                        if k != "num_hidden_layers"}
    assert fields["model_type"] == "qwen3_5_text" and fields["num_hidden_layers"] == 8
    assert fields["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert fields["tie_word_embeddings"] is False and fields["initializer_range"] == 0.02
    assert {k: draft[k] for k in ("hidden_size", "intermediate_size", "vocab_size", "num_hidden_layers",
                                  "num_attention_heads", "num_key_value_heads", "head_dim")} == dict(
        hidden_size=5120, intermediate_size=17408, vocab_size=248320, num_hidden_layers=5, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128)
    assert draft["dflash_config"]["target_layer_ids"] == [1, 2, 3, 4, 5] and draft["num_target_layers"] == 8
    full, full_draft = real_configs(64)
    assert full["layer_types"].count("linear_attention") == 48 and full["layer_types"].count("full_attention") == 16
    assert full_draft["dflash_config"]["target_layer_ids"] == [1, 16, 31, 46, 61]  # z-lab's Qwen3.6-27B-DFlash


@pytest.mark.parametrize("layers", [0, 6, 10, -4])
def test_real_layers_must_be_a_multiple_of_four(layers):
    with pytest.raises(UsageError, match="multiple of 4"):
        real_configs(layers)


def test_unknown_real_override_is_refused():
    with pytest.raises(UsageError, match="hidden_sise, draft.layers"):
        real_configs(4, {"hidden_sise": 64, "draft": {"layers": 2}})


def test_real_configs_pass_sglangs_pair_checks(tmp_path):
    fields, draft = real_configs(8)
    for sub, cfg in (("target", fields), ("draft", draft)):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "config.json").write_text(json.dumps(cfg))
    check_ddtree_pair("REFCHECK_DDTREE", 15, tmp_path / "target", tmp_path / "draft")
    assert resolve_budget("DFLASH", 15, tmp_path / "draft", tmp_path / "target") == 15


def test_tiny_real_pair_layout(tiny_pair):
    target = sorted(p.name for p in (tiny_pair / "target").iterdir())
    assert "model.safetensors.index.json" in target and sum(n.endswith(".safetensors") for n in target) > 1
    index = json.loads((tiny_pair / "target" / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" in index["weight_map"] and "model.embed_tokens.weight" in index["weight_map"]  # untied
    cfg = json.loads((tiny_pair / "target" / "config.json").read_text())
    assert cfg["full_attention_interval"] == 4 and cfg["architectures"] == ["Qwen3_5ForCausalLM"]
    assert cfg["dtype"] == "bfloat16" and cfg["vocab_size"] == 1000 and cfg["tie_word_embeddings"] is False
    check_ddtree_pair("REFCHECK_DDTREE", 15, tiny_pair / "target", tiny_pair / "draft")


def test_tiny_real_pair_decodes_losslessly_in_the_reference(tiny_pair):
    from refcheck.prompts import load_prompts
    from refcheck.reference_runner import ReferenceRunner
    from refcheck.spec import EngineSpec

    runner = ReferenceRunner(EngineSpec(model_dir=tiny_pair / "target", draft_dir=tiny_pair / "draft", budget=15,
                                        max_new_tokens=6))
    assert runner.target.vocab_size == 1000 and runner.drafter.block_size == 16
    assert not torch.equal(runner.target.model.lm_head.weight, runner.target.body.embed_tokens.weight)
    for run in runner.run(load_prompts()[:2], check_ar=True):
        assert run.ar_match, (run.result.output_ids, run.greedy)
        assert len(run.result.steps) >= 1


def test_a_draft_for_another_depth_is_refused(tiny_pair, tmp_path):
    draft = json.loads((tiny_pair / "draft" / "config.json").read_text())
    other = copy.deepcopy(draft)
    other["num_target_layers"] = other["dflash_config"]["num_target_layers"] = 8
    (tmp_path / "config.json").write_text(json.dumps(other))
    with pytest.raises(ModelError, match="8-layer target"):
        check_ddtree_pair("REFCHECK_DDTREE", 15, tiny_pair / "target", tmp_path)


def _digests(d: Path) -> dict[str, str]:
    return {str(f.relative_to(d)): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.rglob("*")) if f.is_file()}


def test_same_seed_same_bytes_and_deeper_builds_share_layers(tiny_pair, tmp_path):
    from safetensors import safe_open

    build_real_pair(tmp_path / "again", layers=4, seed=0, device="cpu", overrides=REAL_TINY, shard_bytes=200_000)
    assert _digests(tmp_path / "again") == _digests(tiny_pair)
    build_real_pair(tmp_path / "seed1", layers=4, seed=1, device="cpu", overrides=REAL_TINY, shard_bytes=None)
    build_real_pair(tmp_path / "deep", layers=8, seed=0, device="cpu", overrides=REAL_TINY, shard_bytes=None)

    def tensor(d: Path, name: str) -> torch.Tensor:
        files = sorted((d / "target").glob("*.safetensors"))
        for f in files:
            with safe_open(str(f), "pt") as h:
                if name in h.keys():
                    return h.get_tensor(name)
        raise KeyError(name)

    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.linear_attn.in_proj_qkv.weight",
                 "model.layers.3.self_attn.q_proj.weight", "model.layers.0.linear_attn.A_log"):
        a = tensor(tiny_pair, name)
        # bf16 words compared as int16: bit for bit
        assert torch.equal(a.view(torch.int16), tensor(tmp_path / "deep", name).view(torch.int16)), name
        assert not torch.equal(a, tensor(tmp_path / "seed1", name)), name
    w = tensor(tiny_pair, "model.layers.0.mlp.up_proj.weight").float()  # fp32 for the statistic
    assert abs(float(w.std()) - REAL_TINY["initializer_range"]) < 0.01


# ------------------------------------------------------------------------------------------- the script
def test_script_build_prints_counts_bytes_and_times(tmp_path, capsys):
    _load_script("real_width").main(["build", "--out", str(tmp_path / "p"), "--tiny", "--layers", "4", "--device", "cpu"])
    info = json.loads(capsys.readouterr().out)
    assert info["target_parameters"] > 0 and info["draft_parameters"] > 0
    assert info["target_bytes"] == sum(f.stat().st_size for f in (tmp_path / "p" / "target").iterdir())
    assert set(info["wall_s"]) >= {"target_build", "target_save", "draft_build", "draft_save", "total", "process"}
    assert json.loads((tmp_path / "p" / "build.json").read_text()) == info


def test_script_refuses_a_bad_layer_count_before_building(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        _load_script("real_width").main(["build", "--out", str(tmp_path / "p"), "--layers", "6", "--device", "cpu"])
    assert exc.value.code == 2 and "multiple of 4" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


def test_script_run_summarises_traces(tiny_pair, tmp_path, monkeypatch):
    """``run`` over a stand-in for the suite's run_config that writes a reference trace where SGLang's goes:
    the summary's bytes per step and rates follow from the file and the entry's timings."""
    from refcheck.prompts import load_prompts
    from refcheck.reference_runner import ReferenceRunner
    from refcheck.spec import EngineSpec
    from refcheck.trace.io import write_trace

    script = _load_script("real_width")
    runner = ReferenceRunner(EngineSpec(model_dir=tiny_pair / "target", draft_dir=tiny_pair / "draft", budget=15,
                                        max_new_tokens=4))
    trace, _ = runner.trace(load_prompts()[:2])
    trace.provenance["engine"]["settings"]["generate_s"] = 2.0
    calls = []

    def fake_run_config(name: str, args: argparse.Namespace, out: Path) -> dict:
        calls.append((name, args.model, args.draft, args.max_new_tokens, args.mem_fraction))
        write_trace(trace, out / f"{name}.arrow")
        return {"rc": 0, "wall_s": 12.0, "engine_start_s": 5.0, "fp32": {"verdict": "pass"}, "bf16": {"wall_s": 4.0}}

    fake = argparse.Namespace(run_config=fake_run_config)
    monkeypatch.setattr(script, "suite", lambda: fake)
    out = tmp_path / "results"
    script.main(["run", "--pair-dir", str(tiny_pair), "--out", str(out), "--algorithms", "ngram,DFLASH"])
    summary = json.loads((out / "summary.json").read_text())
    assert [c[0] for c in calls] == ["ngram", "dflash"]
    assert calls[0][1:] == (str(tiny_pair / "target"), str(tiny_pair / "draft"), 32, 0.45)
    e = summary["DFLASH"]
    rows = len(trace.steps)
    assert e["trace"]["step_rows"] == rows and e["trace"]["bytes"] == (out / "dflash.arrow").stat().st_size
    assert e["trace"]["bytes_per_step"] == round(e["trace"]["bytes"] / rows, 1)
    assert e["diff_s_fp32"] == 5.0 and e["diffed_steps_per_s_fp32"] == round(rows / 5.0, 2)
    assert e["diffed_steps_per_s_bf16_replay"] == round(rows / 4.0, 2)
    assert "state" in e["trace"]["uncompressed_bytes_per_step"]
    assert summary["pair"]["target"]["vocab_size"] == 1000 and summary["pair"]["draft_layers"] == 2
    script.main(["run", "--pair-dir", str(tiny_pair), "--out", str(out), "--algorithms", "REFCHECK_DDTREE"])
    assert set(json.loads((out / "summary.json").read_text())) == {"pair", "NGRAM", "DFLASH", "REFCHECK_DDTREE"}
    calls.clear()  # at tensor parallelism 2: the suite's -tp2 configurations, each of which exists
    script.main(["run", "--pair-dir", str(tiny_pair), "--out", str(out), "--algorithms", "REFCHECK_DDTREE,NGRAM,DFLASH",
                 "--tp", "2"])
    assert [c[0] for c in calls] == ["ddtree-b15-tp2", "ngram-tp2", "dflash-tp2"]
    configs = _load_script("sglang_suite").CONFIGS
    assert all(configs[name][-2:] == ["--tp", "2"] for name, *_ in calls)
