"""The built-in models' training pipeline: corpus, tokenizer, the batched DFlash training forward
(must equal the reference drafter), and a smoke run whose checkpoints load everywhere."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer

from ddtree_reference.drafter import DFlashDrafter
from ddtree_reference.target import Target
from refcheck.models import MODELS_DIR, builtin_pair
from refcheck.models.corpus import KINDS, corpus_sha256, generate_corpus
from refcheck.models.train import TrainConfig, context_features, draft_block_logits, train_pair
from refcheck.prompts import load_prompts


def test_corpus_is_deterministic_and_has_three_kinds():
    a, b = generate_corpus(3, 300), generate_corpus(3, 300)
    assert corpus_sha256(a) == corpus_sha256(b) != corpus_sha256(generate_corpus(4, 300))
    assert {k for k, _ in a} == set(KINDS)


def test_tokenizer_specials_and_readable_prompts():
    tok = Tokenizer.from_file(str(MODELS_DIR / "tokenizer.json"))
    assert tok.token_to_id("<|endoftext|>") == 0 and tok.token_to_id("<|mask|>") == 1
    assert tok.get_vocab_size() == 512
    for p in load_prompts():
        assert tok.decode(list(p.prompt_ids)) == json.loads(
            next(line for line in (MODELS_DIR.parent / "prompts" / "builtin.jsonl").read_text().splitlines()
                 if json.loads(line)["id"] == p.id))["text"]
    assert {p.kind for p in load_prompts()} == {"code", "arithmetic", "prose"}


@pytest.mark.parametrize("which", ["hybrid", "attention"])
def test_training_forward_equals_reference_drafter(which, request):
    target, drafter = request.getfixturevalue(which)
    prompt = list(load_prompts()[0].prompt_ids)
    ids = torch.tensor(prompt)
    _, fwd = target.prefill(ids, capture=tuple(drafter.target_layer_ids))
    with torch.no_grad():
        feats = context_features(target.model, ids[None], drafter.target_layer_ids)  # [1, P, nL*H]
    assert (feats[0] - fwd.context).abs().max() < 1e-4
    bonus, a = int(fwd.logits[-1].argmax()), len(prompt)
    drafter.reset()
    drafter.extend(fwd.context, torch.arange(a), ids)
    ref = drafter.logits(bonus, a)  # [bs-1, V]
    from safetensors.torch import load_file

    tdir, ddir = builtin_pair(which)
    w = {k: v.float() for k, v in load_file(str(ddir / "model.safetensors")).items()}
    dcfg = json.loads((ddir / "config.json").read_text())
    bs = drafter.block_size
    # context padded beyond the anchor must be masked out
    pad = torch.cat([feats, torch.randn(1, 5, feats.shape[-1])], dim=1)
    valid = torch.arange(a + 5)[None] < a
    blk = torch.full((1, bs), drafter.mask_token_id)
    blk[0, 0] = bonus
    with torch.no_grad():
        got = draft_block_logits(w, dcfg, target.body.embed_tokens.weight, target.model.lm_head.weight, pad, valid,
                                 blk, torch.arange(a, a + bs)[None])[0]
    assert (got - ref).abs().max() < 1e-4


def test_builtin_models_are_trained():
    for pair in ("hybrid", "attention"):
        info = json.loads((MODELS_DIR / pair / "training.json").read_text())
        assert info["final_target_loss"] < 1.5 and info["final_draft_loss"] < 1.0
        assert info["corpus_sha256"] == corpus_sha256(generate_corpus(info["config"]["seed"]))


def test_quick_training_produces_loadable_checkpoints(tmp_path):
    cfg = TrainConfig(target_steps=2, draft_steps=2, distill_prompts=8, distill_new=20, target_batch=4, draft_batch=4)
    info = train_pair("hybrid", tmp_path / "hybrid", MODELS_DIR / "tokenizer.json", cfg, "cpu", log=lambda m: None)
    assert set(info["wall_s"]) == {"corpus", "target", "distill", "draft"}
    target = Target.load(tmp_path / "hybrid" / "target")
    drafter = DFlashDrafter.load(tmp_path / "hybrid" / "draft", target)
    cfg_json = json.loads((tmp_path / "hybrid" / "target" / "config.json").read_text())
    assert cfg_json["full_attention_interval"] == 3 and "rope_theta" in cfg_json  # SGLang reads these
    assert drafter.mask_token_id == 1
    dflash_model = pytest.importorskip("dflash.model")
    dflash_model.DFlashDraftModel.from_pretrained(str(tmp_path / "hybrid" / "draft"))


def test_the_wide_pair_has_the_calibration_corpus_shape():
    """The corpus's wider hybrid: hidden 1024, 8 layers at 3 Gated DeltaNet : 1 full attention, its drafter
    as wide and reading that target's layers (built and trained on the GPU; not shipped)."""
    from refcheck.models.build import TARGET_CONFIGS, draft_config, widths

    spec, w = TARGET_CONFIGS["wide"], widths("wide")
    assert w["hidden_size"] >= 1024 and spec["num_hidden_layers"] >= 8
    assert spec["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 2
    d = draft_config(spec["num_hidden_layers"], "wide")
    assert d["hidden_size"] == w["hidden_size"] and max(d["dflash_config"]["target_layer_ids"]) < 8
    assert widths("hybrid")["hidden_size"] == 128 and draft_config(6)["hidden_size"] == 128  # the tiny pairs unchanged
