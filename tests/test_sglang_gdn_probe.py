"""The GDN probe (refcheck/sglang/capture/gdn_probe.py) and its checker, on CPU: records written by the
hook from a stand-in module hold what the kernels received; the checker finds each row's trace step,
passes a faithful engine, blames the execution for a core output its own inputs do not give, and blames
the inputs when they are off."""

from __future__ import annotations

import types

import pytest
import torch

from refcheck.errors import UsageError
from refcheck.goldens import REPO_GOLDEN
from refcheck.pool import ReferencePool, reference_spec_for
from refcheck.sglang.capture import gdn_probe
from refcheck.sglang.capture.gdn_probe_check import check_probe, match_step, read_probes
from refcheck.sglang.capture.gdn_replay import ReferenceKernels, gdn_inputs, split_qkv, tree_links
from refcheck.trace.io import read_trace

STEPS = (("code-1", 13), ("code-2", 3))


@pytest.fixture(scope="module")
def b64():
    trace = read_trace(REPO_GOLDEN / "sglang-hybrid-ddtree-b64.arrow")
    return trace, ReferencePool().runner(reference_spec_for(trace)).target


def _record(trace, target, edit=None) -> dict:
    """A probe record as SGLang's layer 0 would give it for a batch of STEPS, made from the reference's
    inputs; ``edit(row, inp)`` may change a row's inputs before its core output is computed."""
    rows, kern = [], ReferenceKernels()
    for b, (rid, step) in enumerate(STEPS):
        (inp,) = gdn_inputs(trace, rid, step, target, [0])
        s = [x for x in trace.steps_of(rid) if x.step == step][0]
        if edit:
            edit(b, inp)
        nt, ns = tree_links(inp.parents)
        conv, _ = kern.conv(inp, nt, ns)
        core = kern.recurrent(inp, *split_qkv(inp, conv), inp.parents)
        rows.append((s, inp, nt, ns, core))
    cat = lambda xs: torch.cat(list(xs))  # noqa: E731
    return {"file": "gdn-1-00000.pt", "layer": 0, "draft_token_num": 65,
            "seq_lens": torch.tensor([int(s.committed_len) - 1 for s, *_ in rows]),
            "input_ids": torch.tensor([t for s, *_ in rows for t in s.tree_tokens]),
            "next_token": torch.stack([r[2] for r in rows]), "next_sibling": torch.stack([r[3] for r in rows]),
            "parent": torch.stack([r[1].parents for r in rows]),
            "mixed_qkv": cat(r[1].mixed_qkv for r in rows), "a": cat(r[1].a for r in rows),
            "b": cat(r[1].b for r in rows),
            "conv_state": torch.stack([r[1].conv_state.T for r in rows]),  # [bs, C, K-1]
            "ssm_state": torch.stack([r[1].recurrent_state.transpose(-1, -2) for r in rows]),  # [bs, HV, V, K]
            "core": cat(r[4] for r in rows)}


def _over(errs, tol=1e-3):
    return [i for i, e in enumerate(errs) if e > tol]


def test_rows_find_their_steps_and_a_faithful_engine_passes(b64):
    trace, target = b64
    rec = _record(trace, target)
    for r, (rid, step) in enumerate(STEPS):
        c = check_probe(rec, r, trace, target, ReferenceKernels())
        assert (c.request_id, c.step, c.batch_size) == (rid, step, 2)
        assert max(c.inputs.values()) < 1e-6 and c.parents_agree and not c.notes
        assert not _over(c.core_vs_ref, 1e-5) and not _over(c.core_vs_isolated, 1e-5)
    assert match_step(trace, [1, 2, 3], 10) is None


def test_an_output_its_own_inputs_do_not_give_is_the_engine_s_execution(b64):
    trace, target = b64
    rec = _record(trace, target)
    rec["core"][32] += 0.5 * rec["core"][32].norm() + 0.1  # row 0, node 32: computed from something else
    c = check_probe(rec, 0, trace, target, ReferenceKernels())
    assert _over(c.core_vs_ref) == [32] and _over(c.core_vs_isolated) == [32] and not _over(c.mixed_qkv_rel)
    assert not _over(check_probe(rec, 1, trace, target, ReferenceKernels()).core_vs_ref)


def test_wrong_inputs_are_blamed_on_the_inputs(b64):
    trace, target = b64

    def edit(b, inp):
        if b == 1:
            inp.mixed_qkv[5] = -inp.mixed_qkv[5]
    rec = _record(trace, target, edit)
    c = check_probe(rec, 1, trace, target, ReferenceKernels())
    assert _over(c.mixed_qkv_rel) == [5] and 5 in _over(c.core_vs_ref) and not _over(c.core_vs_isolated, 1e-5)


def test_the_hook_records_verify_forwards_only(tmp_path, monkeypatch, b64):
    trace, target = b64
    rec = _record(trace, target)
    monkeypatch.setenv(gdn_probe.ENV_DIR, str(tmp_path))
    pool = types.SimpleNamespace(conv=[rec["conv_state"]], temporal=rec["ssm_state"],
                                 intermediate_ssm=torch.zeros(1, 65))
    backend = types.SimpleNamespace(
        req_to_token_pool=types.SimpleNamespace(mamba2_layer_cache=lambda layer: pool),
        forward_metadata=types.SimpleNamespace(mamba_cache_indices=torch.tensor([0, 1]), retrieve_parent_token=rec["parent"]))
    monkeypatch.setattr(gdn_probe, "_backend", lambda fb: backend)

    class Attn(torch.nn.Module):
        layer_id = 0

        def forward(self, forward_batch, mixed_qkv, a, b):
            return rec["core"].reshape(1, -1, *rec["core"].shape[-2:])

    def batch(verify):
        mode = types.SimpleNamespace(is_target_verify=lambda: verify)
        info = types.SimpleNamespace(draft_token_num=65, retrieve_next_token=rec["next_token"],
                                     retrieve_next_sibling=rec["next_sibling"])
        return types.SimpleNamespace(forward_mode=mode, batch_size=2, seq_lens=rec["seq_lens"],
                                     input_ids=rec["input_ids"], spec_info=info)

    m = Attn()
    m.register_forward_hook(gdn_probe.hook_factory({}))
    args = dict(mixed_qkv=rec["mixed_qkv"], a=rec["a"], b=rec["b"])
    m(batch(True), **args)  # the first call installs the keyword pre-hook; not recorded
    m(batch(False), **args)  # an extend: not recorded
    m(batch(True), **args)
    (got,) = read_probes(tmp_path)
    for k in ("mixed_qkv", "a", "b", "conv_state", "ssm_state", "core", "parent", "input_ids", "next_token"):
        assert torch.equal(got[k], rec[k]), k
    assert got["intermediate_steps"] == 65 and got["draft_token_num"] == 65
    c = check_probe(got, 0, trace, target, ReferenceKernels())
    assert (c.request_id, c.step) == STEPS[0] and not _over(c.core_vs_ref, 1e-5)
    assert gdn_probe.spec()["target_modules"] == ["model.layers.0.linear_attn.attn"]


def test_an_empty_probe_directory_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="no GDN probe records"):
        read_probes(tmp_path)


def test_a_probe_failure_never_breaks_the_forward(tmp_path, monkeypatch):
    monkeypatch.setenv(gdn_probe.ENV_DIR, str(tmp_path))

    def broken(fb):
        raise AttributeError("no linear attention backend here")
    monkeypatch.setattr(gdn_probe, "_backend", broken)

    class Attn(torch.nn.Module):
        layer_id = 3

        def forward(self, forward_batch, mixed_qkv):
            return mixed_qkv * 2

    m = Attn()
    m.register_forward_hook(gdn_probe.hook_factory({}))
    fb = types.SimpleNamespace(forward_mode=types.SimpleNamespace(is_target_verify=lambda: True))
    x = torch.ones(3)
    for _ in range(3):
        assert torch.equal(m(fb, mixed_qkv=x), 2 * x)
    assert (tmp_path / "errors.txt").read_text().count("layer 3 inputs: AttributeError") == 1
    assert not list(tmp_path.glob("gdn-*.pt"))
