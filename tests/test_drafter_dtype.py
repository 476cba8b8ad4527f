"""The drafter in a half-precision model dtype: its weights take the dtype, its rotary frequencies stay float32.

A bf16 inv_freq turns the rotary angle at position p by up to p x 2^-8 x inv_freq: at a few hundred tokens such a
drafter's draft log-probs are 0.4-0.8 off the float32 drafter's (docs/results/long-context-bf16/).
"""

from __future__ import annotations

import pytest
import torch

from ddtree_reference.drafter import DFlashDrafter
from ddtree_reference.target import Target
from refcheck.models import builtin_pair


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_drafter_keeps_float32_rotary_frequencies(hybrid, dtype):
    target32, drafter32 = hybrid
    tdir, ddir = builtin_pair("hybrid")
    drafter = DFlashDrafter.load(ddir, Target.load(tdir, dtype))
    assert drafter.fc.weight.dtype == dtype and drafter.layers[0].self_attn.q_proj.weight.dtype == dtype
    for name, buf in drafter.rotary_emb.named_buffers():
        assert buf.dtype == torch.float32, name
        assert torch.equal(buf, dict(drafter32.rotary_emb.named_buffers())[name]), name
    positions = torch.tensor([0, 450, 4000])
    cos, sin = drafter._rope(positions, torch.zeros(3, drafter32.head_dim, dtype=dtype))  # [3, D] in dtype
    cos32, sin32 = drafter32._rope(positions, torch.zeros(3, drafter32.head_dim))
    unit = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11  # one rounding of a value in [-1, 1]
    assert cos.dtype == dtype
    assert float((cos.float() - cos32).abs().max()) <= unit and float((sin.float() - sin32).abs().max()) <= unit


def test_the_rounded_rotary_fault_moves_long_context_drafts_and_leaves_the_drafter_as_it_was(hybrid):
    """``draft-rope-bf16`` (the bug above, as a corpus fault): the drafts at a 438-token context move; the shared
    drafter keeps its exact frequencies afterwards."""
    from ddtree_reference.decode import DDTreeDecoder, DecodeConfig
    from refcheck.prompts.workloads import workload
    from refcheck.selftest.faults import LONG_CONTEXT_FAULTS

    target, drafter = hybrid
    exact = drafter.rotary_emb.inv_freq.clone()
    prompt = list(next(p for p in workload("mixed") if p.id == "mixed-04").prompt_ids)  # 438 tokens
    cfg = DecodeConfig(budget=15, max_new_tokens=2, keep_states=True)
    clean = DDTreeDecoder(target, drafter, cfg).generate(prompt).steps[0].draft_logprobs  # [L, V]
    faulty = LONG_CONTEXT_FAULTS["draft-rope-bf16"][0](target, drafter, cfg).generate(prompt).steps[0].draft_logprobs
    assert torch.equal(drafter.rotary_emb.inv_freq, exact)
    assert float((faulty - clean).abs().max()) > 0.05
    again = DDTreeDecoder(target, drafter, cfg).generate(prompt).steps[0].draft_logprobs
    assert torch.equal(again, clean)
