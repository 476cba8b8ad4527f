"""Our DFlash drafter and chain mode against z-lab's ``dflash`` package (PyPI, installed --no-deps)."""

from __future__ import annotations

import time

import pytest
import torch

dflash_model = pytest.importorskip("dflash.model")

from ddtree_reference.decode import DDTreeDecoder, DecodeConfig  # noqa: E402
from refcheck.models import builtin_pair  # noqa: E402

PROMPT = [17, 3, 99, 250, 41, 8, 8, 120, 77, 5, 301, 64]


def _zlab_drafter(which: str):
    _, ddir = builtin_pair(which)
    return dflash_model.DFlashDraftModel.from_pretrained(str(ddir), dtype=torch.float32).eval()


@pytest.mark.parametrize("which", ["hybrid", "attention"])
def test_drafter_forward_equals_zlab(which, request):
    target, ours = request.getfixturevalue(which)
    theirs = _zlab_drafter(which)
    assert theirs.target_layer_ids == ours.target_layer_ids
    state, fwd = target.prefill(torch.tensor(PROMPT), capture=tuple(ours.target_layer_ids))
    bonus, start = int(fwd.logits[-1].argmax()), len(PROMPT)
    ours.reset()
    ours.extend(fwd.context, torch.arange(start), torch.tensor(PROMPT))
    mine = ours.hidden(bonus, start)  # [bs, H]

    block = torch.full((1, ours.block_size), ours.mask_token_id)
    block[0, 0] = bonus
    noise = torch.nn.functional.embedding(block, target.body.embed_tokens.weight)
    with torch.no_grad():
        ref = theirs(
            target_hidden=fwd.context.unsqueeze(0),
            noise_embedding=noise,
            position_ids=torch.arange(start + ours.block_size).unsqueeze(0),
            use_cache=False,
        )[0]
    assert (mine - ref).abs().max() < 1e-5
    logits_ref = theirs.compute_logits(ref[1:], target.model.lm_head)
    assert torch.equal(ours.logits(bonus, start).argmax(-1), logits_ref.argmax(-1))


def test_chain_mode_equals_zlab_dflash_generate_on_attention_target(attention, monkeypatch):
    target, ours = attention
    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)  # CPU: no CUDA sync
    theirs = _zlab_drafter("attention")
    for max_new in (40, 13):
        zlab = dflash_model.dflash_generate(
            theirs, target.model, torch.tensor([PROMPT]), max_new_tokens=max_new, stop_token_ids=None, return_stats=True
        )
        res = DDTreeDecoder(target, ours, DecodeConfig(budget=None, max_new_tokens=max_new)).generate(PROMPT)
        assert res.output_ids == zlab.output_ids[0, len(PROMPT):].tolist()
        assert [len(s.emitted) for s in res.steps] == zlab.acceptance_lengths
