"""scripts/state_bytes.py: a trace deepened to 64 layers holds 128 state entries per step, in the form asked."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from script_loader import load_script

from refcheck.trace.io import read_trace

sb = load_script("state_bytes")
GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "sglang-hybrid-ddtree-b15.arrow"


def test_deepened_steps_hold_every_layers_entries_in_the_form_asked():
    trace = read_trace(GOLDEN)
    for rows_form in (False, True):
        deep = sb.deepened(trace, 64, 4, 48, 3, rows_form)
        s = deep.steps[0]
        assert len(s.state) == 128 and {e.kind for e in s.state} == {"kv_k", "kv_v", "conv", "rec"}
        rec = next(e for e in s.state if e.kind == "rec")
        kv = next(e for e in s.state if e.kind == "kv_k")
        assert rec.sketch.shape[0] == (48 if rows_form else 1) and kv.sketch.shape[0] == (len(s.accepted) if rows_form else 1)
        assert (rec.sketch.dtype == torch.float32) if rows_form else rec.sketch.dtype == trace.steps[0].state[0].sketch.dtype
        assert [x.tree_tokens for x in deep.steps] == [x.tree_tokens for x in trace.steps]


def test_the_script_prints_bytes_per_step_for_both_forms(capsys):
    assert sb.main([str(GOLDEN), "--layers", "8"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["entries_per_step"] == 16 and out["without_state"] < out["state_sketch"] < out["row_sketches"]
