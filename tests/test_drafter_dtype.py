"""The drafter in a half-precision model dtype: its weights take the dtype, its rotary frequencies stay float32.

A bf16 inv_freq turns the rotary angle at position p by up to p x 2^-8 x inv_freq: at a few hundred tokens the bf16
drafter's draft log-probs moved by 0.4-0.8 from the float32 drafter's (docs/results/long-context-bf16/).
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
