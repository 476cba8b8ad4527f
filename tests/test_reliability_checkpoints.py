"""Strict checkpoint loading: a target or draft checkpoint whose tensors do not match the model (one
missing, one of the wrong shape, one unexpected, one of an integer dtype) is refused with a
CheckpointTensorsError naming the tensors (the first few and the count), and the CLI exits 6 with that
message and no traceback; the intact built-in checkpoints load and decode the same tokens twice."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ddtree_reference.drafter import DFlashDrafter
from ddtree_reference.errors import CheckpointError, CheckpointTensorsError
from ddtree_reference.target import Target
from refcheck.errors import EXIT_MODEL, EXIT_PASS, exit_code_for
from refcheck.models import builtin_pair

Weights = dict[str, torch.Tensor]
DOWN = "model.layers.3.mlp.down_proj.weight"  # a target tensor (a Gated DeltaNet layer's MLP)
DRAFT_DOWN = "layers.1.mlp.down_proj.weight"
ONE_PROMPT = '{"id": "a", "prompt_ids": [30, 31, 32, 33, 34, 35]}\n'


def _copy(src: Path, dst: Path, edit: Callable[[Weights], object] = lambda w: None) -> Path:
    """``src`` copied to ``dst`` with its weights passed through ``edit`` (in place)."""
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    edit(weights)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _reshaped(name: str) -> Callable[[Weights], None]:
    def edit(w: Weights) -> None:
        rows, cols = w[name].shape
        w[name] = torch.zeros(rows, cols - 2, dtype=w[name].dtype)
    return edit


def _as_int(name: str) -> Callable[[Weights], None]:
    def edit(w: Weights) -> None:
        w[name] = torch.ones(w[name].shape, dtype=torch.int32)  # integer on purpose: the fault under test
    return edit


def _extra(name: str) -> Callable[[Weights], None]:
    def edit(w: Weights) -> None:
        w[name] = torch.zeros(4, dtype=torch.bfloat16)
    return edit


TARGET_FAULTS = [
    pytest.param(lambda w: w.pop(DOWN), "missing", rf"1 missing tensor: {DOWN} ", id="missing"),
    pytest.param(_reshaped(DOWN), "wrong_shape", rf"1 tensor of the wrong shape: {DOWN} \(checkpoint \[128, 190\], "
                 r"model \[128, 192\]\)", id="wrong-shape"),
    pytest.param(_extra("model.layers.3.mlp.extra.weight"), "unexpected",
                 r"1 unexpected tensor: model\.layers\.3\.mlp\.extra\.weight", id="unexpected"),
    pytest.param(_as_int(DOWN), "wrong_dtype", rf"1 non-floating-point tensor: {DOWN} \(I32\)", id="integer-dtype"),
]


@pytest.mark.parametrize("edit, kind, message", TARGET_FAULTS)
def test_target_refuses_mismatched_tensors(tmp_path, edit, kind, message):
    tdir = _copy(builtin_pair("hybrid")[0], tmp_path / "target", edit)
    with pytest.raises(CheckpointTensorsError, match=rf"target checkpoint {tmp_path}/target does not match the model: "
                                                     + message) as exc:
        Target.load(tdir)
    assert exit_code_for(exc.value) == EXIT_MODEL
    named = {"missing": exc.value.missing, "wrong_shape": exc.value.wrong_shape,
             "unexpected": exc.value.unexpected, "wrong_dtype": exc.value.wrong_dtype}
    assert [k for k, names in named.items() if names] == [kind]


def test_target_error_names_first_few_missing_and_the_count(tmp_path):
    def drop_mlps(w: Weights) -> None:
        for name in [k for k in w if k.endswith("mlp.down_proj.weight")]:
            del w[name]

    tdir = _copy(builtin_pair("hybrid")[0], tmp_path / "target", drop_mlps)
    with pytest.raises(CheckpointTensorsError, match=r"6 missing tensors: model\.layers\.0\.mlp\.down_proj\.weight, "
                                                     r"(\S+, ){4}and 1 more") as exc:
        Target.load(tdir)
    assert len(exc.value.missing) == 6


def test_target_refuses_a_tensor_in_two_shards(tmp_path):
    """Two shards holding one name: which a loader takes is undefined, so the checkpoint is refused."""
    tdir = _copy(builtin_pair("hybrid")[0], tmp_path / "target")
    weights = load_file(str(tdir / "model.safetensors"))
    names = sorted(weights)
    shards = {"a.safetensors": names[:40] + [DOWN], "b.safetensors": names[40:]}
    (tdir / "model.safetensors").unlink()
    for file, keys in shards.items():
        save_file({k: weights[k] for k in keys}, str(tdir / file), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (tdir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"tensor {DOWN} is in both a\.safetensors and b\.safetensors"):
        Target.load(tdir)


def test_sharded_target_loads_strictly(tmp_path, hybrid):
    """A sharded checkpoint (index + shards) loads and equals the single-file one; a tensor dropped from
    one shard is reported missing."""
    target = hybrid[0]
    target.model.save_pretrained(str(tmp_path / "sharded"), max_shard_size="400KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    loaded = Target.load(tmp_path / "sharded")
    ids = torch.arange(5, 20)
    assert torch.equal(loaded.prefill(ids)[1].logits, target.prefill(ids)[1].logits)
    shard = next(f for f in sorted((tmp_path / "sharded").glob("*.safetensors")) if DOWN in load_file(str(f)))
    weights = load_file(str(shard))
    del weights[DOWN]
    save_file(weights, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointTensorsError, match=rf"1 missing tensor: {DOWN}"):
        Target.load(tmp_path / "sharded")


DRAFT_FAULTS = [
    pytest.param(lambda w: w.pop(DRAFT_DOWN), rf"1 missing tensor: {DRAFT_DOWN} ", id="missing"),
    pytest.param(_reshaped(DRAFT_DOWN), rf"1 tensor of the wrong shape: {DRAFT_DOWN} \(checkpoint \[128, 190\], "
                 r"model \[128, 192\]\)", id="wrong-shape"),
    pytest.param(_extra("layers.1.mlp.extra.weight"), r"1 unexpected tensor: layers\.1\.mlp\.extra\.weight",
                 id="unexpected"),
    pytest.param(_as_int(DRAFT_DOWN), rf"1 non-floating-point tensor: {DRAFT_DOWN} \(I32\)", id="integer-dtype"),
]


@pytest.mark.parametrize("edit, message", DRAFT_FAULTS)
def test_draft_refuses_mismatched_tensors(tmp_path, hybrid, edit, message):
    ddir = _copy(builtin_pair("hybrid")[1], tmp_path / "draft", edit)
    with pytest.raises(CheckpointTensorsError, match=rf"draft checkpoint {tmp_path}/draft does not match the model: "
                                                     + message):
        DFlashDrafter.load(ddir, hybrid[0])


def test_draft_ignores_its_own_embeddings_and_lm_head(tmp_path, hybrid):
    """DFlash takes the token embeddings and LM head from the target; a draft checkpoint's own are skipped."""
    target, drafter = hybrid
    extra = {"model.embed_tokens.weight": target.body.embed_tokens.weight.detach().to(torch.bfloat16).clone(),
             "lm_head.weight": target.model.lm_head.weight.detach().to(torch.bfloat16).clone()}
    ddir = _copy(builtin_pair("hybrid")[1], tmp_path / "draft", lambda w: w.update(extra))
    loaded = DFlashDrafter.load(ddir, target)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), drafter.state_dict().values()))


def _run(cli, tdir: Path, ddir: Path, prompts: Path) -> tuple[int, str, str]:
    return cli("run", "--model", str(tdir), "--draft", str(ddir), "--max-new-tokens", "6",
               "--prompts", str(prompts), "--json")


@pytest.mark.parametrize("which, edit, message", [
    pytest.param("target", lambda w: w.pop(DOWN), rf"1 missing tensor: {DOWN}", id="target-missing"),
    pytest.param("draft", _reshaped(DRAFT_DOWN), rf"1 tensor of the wrong shape: {DRAFT_DOWN}", id="draft-wrong-shape"),
])
def test_cli_run_refuses_mismatched_checkpoint(tmp_path, cli, which, edit, message):
    tsrc, dsrc = builtin_pair("hybrid")
    tdir = _copy(tsrc, tmp_path / "target", edit if which == "target" else lambda w: None)
    ddir = _copy(dsrc, tmp_path / "draft", edit if which == "draft" else lambda w: None)
    (tmp_path / "p.jsonl").write_text(ONE_PROMPT)
    code, out, err = _run(cli, tdir, ddir, tmp_path / "p.jsonl")
    assert code == EXIT_MODEL, (out, err)
    assert "Traceback" not in out + err
    assert f"{which} checkpoint {tmp_path}/{which} does not match the model" in err
    assert re.search(message, err), err


@pytest.mark.parametrize("pair", ["hybrid", "attention"])
def test_intact_builtin_checkpoints_decode_identically_twice(tmp_path, cli, pair):
    """The built-in checkpoints are complete: loaded strictly (copied, as a user's directory), two runs give
    the same tokens."""
    tsrc, dsrc = builtin_pair(pair)
    tdir, ddir = _copy(tsrc, tmp_path / "target"), _copy(dsrc, tmp_path / "draft")
    (tmp_path / "p.jsonl").write_text(ONE_PROMPT)
    outputs = []
    for _ in range(2):
        code, out, err = _run(cli, tdir, ddir, tmp_path / "p.jsonl")
        assert code == EXIT_PASS, err
        outputs.append([p["output_ids"] for p in json.loads(out)["prompts"]])
    assert outputs[0] == outputs[1]
    assert len(outputs[0][0]) == 6
