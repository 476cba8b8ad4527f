"""The GDN probe's records, checked against the reference and against the kernels run in isolation.

Contract: :func:`read_probes` loads the records :mod:`refcheck.sglang.capture.gdn_probe` wrote;
:func:`check_probe` takes one request row of one record, finds the trace step it belongs to (the same
tree tokens; the committed length nearest the engine's), and answers three questions per node, each a
relative L2 distance:

* ``inputs``: did the engine hand its kernels what the reference computes there (``mixed_qkv``,
  ``a``, ``b``) and start from the reference's committed conv / recurrent state (``conv_state``,
  ``ssm_state``, whole-tensor distances)?
* ``core_vs_ref``: how far is the engine's core output from the reference's?
* ``core_vs_isolated``: how far is it from what a kernel set (SGLang's, or the PyTorch stand-ins)
  computes from *the engine's own* inputs and state, one request alone with fresh scratch buffers?

A node far from the reference but equal to its isolated replay is explained by its inputs; a node
whose engine output differs from the isolated replay of its own inputs was computed differently
inside the engine (shared scratch, another request of the batch, a stale buffer): the fault is the
engine's execution, not the kernels' math. ``parents_agree``: the parent links SGLang's conv kernel
wrote equal the tree's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ddtree_reference.target import Target
from refcheck.errors import CorruptTraceError, UsageError
from refcheck.sglang.capture.gdn_replay import GDNStepInputs, gdn_inputs, parents_from_links, split_qkv
from refcheck.sketch import rel_l2
from refcheck.trace.io import Trace


def read_probes(directory: Path) -> list[dict]:
    """The records of a probe directory, in write order (pid, then counter)."""
    files = sorted(Path(directory).glob("gdn-*.pt"))
    if not files:
        raise UsageError(f"no GDN probe records (gdn-*.pt) in {directory}")
    return [_load_probe(f) | {"file": f.name} for f in files]


def _load_probe(path: Path) -> dict:
    """One probe record: tensors and plain Python values only (``weights_only=True``: a file from a
    user-named directory never runs code); anything else is a corrupt record."""
    try:
        rec = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises pickle/runtime errors of many kinds
        raise CorruptTraceError(f"GDN probe record {path} is unreadable or not plain data: "
                                f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}") from None
    if not isinstance(rec, dict):
        raise CorruptTraceError(f"GDN probe record {path} is a {type(rec).__name__}, not a dict")
    return rec


@dataclass(slots=True)
class ProbeCheck:
    file: str
    row: int
    request_id: str
    step: int
    layer: int
    batch_size: int
    inputs: dict[str, float]  # whole-tensor rel L2 of the engine's inputs and committed state vs the reference's
    mixed_qkv_rel: list[float]  # per node
    core_vs_ref: list[float]  # per node
    core_vs_isolated: list[float]  # per node
    parents_agree: bool
    notes: list[str] = field(default_factory=list)


def _row(rec: dict, r: int) -> tuple[list[int], int]:
    n = rec["draft_token_num"]
    return rec["input_ids"][r * n:(r + 1) * n].tolist(), int(rec["seq_lens"][r])


def match_step(trace: Trace, tokens: list[int], seq_len: int) -> tuple[str, int] | None:
    """(request id, step) of the trace step that verified ``tokens`` with the committed length nearest
    ``seq_len`` (SGLang's seq_lens counts the KV rows, the root not yet among them)."""
    best = None
    for req in trace.requests:
        for s in trace.steps_of(req.request_id):
            if list(s.tree_tokens) == tokens:
                gap = abs(int(s.committed_len) - 1 - seq_len)
                if best is None or gap < best[0]:
                    best = (gap, req.request_id, s.step)
    return None if best is None else (best[1], best[2])


def engine_inputs(rec: dict, r: int, ref: GDNStepInputs) -> GDNStepInputs:
    """The engine's inputs of request row ``r`` in the reference's layout (weights are the reference's)."""
    n = rec["draft_token_num"]
    rows = slice(r * n, (r + 1) * n)
    dev = ref.mixed_qkv.device
    nt, ns = rec["next_token"][r], rec["next_sibling"][r]
    return GDNStepInputs(
        layer=ref.layer, parents=parents_from_links(nt, ns).to(dev),
        mixed_qkv=rec["mixed_qkv"][rows].to(dev), a=rec["a"][rows].to(dev), b=rec["b"][rows].to(dev),
        conv_state=rec["conv_state"][r].T.contiguous().to(dev),  # [C, K-1] -> [K-1, C]
        recurrent_state=rec["ssm_state"][r].transpose(-1, -2).float().to(dev),  # [HV, V, K] -> [HV, K, V]; fp32 like the kernel's state
        weight=ref.weight, bias=ref.bias, A_log=ref.A_log, dt_bias=ref.dt_bias, dims=ref.dims,
        conv_out=torch.empty(0), core=torch.empty(0))


@torch.no_grad()
def check_probe(rec: dict, r: int, trace: Trace, target: Target, kernels) -> ProbeCheck:
    tokens, seq_len = _row(rec, r)
    hit = match_step(trace, tokens, seq_len)
    layer = int(rec["layer"])
    n = rec["draft_token_num"]
    if hit is None:
        raise UsageError(f"{rec['file']} row {r}: no step of the trace verified this tree (seq_len {seq_len})")
    rid, step = hit
    ref = gdn_inputs(trace, rid, step, target, [layer])[0]
    eng = engine_inputs(rec, r, ref)
    notes = []
    if not torch.equal(eng.parents.cpu(), ref.parents.cpu()):
        notes.append("the engine's first-child/next-sibling links describe another tree than the trace's")
    inputs = {"mixed_qkv": rel_l2(eng.mixed_qkv.float(), ref.mixed_qkv.float()),
              "a": rel_l2(eng.a.float(), ref.a.float()), "b": rel_l2(eng.b.float(), ref.b.float()),
              "conv_state": rel_l2(eng.conv_state.float(), ref.conv_state.float()),
              "ssm_state": rel_l2(eng.recurrent_state, ref.recurrent_state.float())}
    core = rec["core"][r * n:(r + 1) * n].float().to(ref.core.device)  # [N, HV, V]
    nt, ns = rec["next_token"][r], rec["next_sibling"][r]
    iso_conv, _ = kernels.conv(eng, nt, ns)
    iso_core = kernels.recurrent(eng, *split_qkv(eng, iso_conv), eng.parents).float()
    parent = rec.get("parent")
    agree = parent is None or all(int(parent[r][i]) == int(eng.parents[i]) for i in range(1, n))
    return ProbeCheck(
        file=rec["file"], row=r, request_id=rid, step=step, layer=layer, batch_size=len(rec["seq_lens"]),
        inputs=inputs,
        mixed_qkv_rel=[rel_l2(eng.mixed_qkv[i].float(), ref.mixed_qkv[i].float()) for i in range(n)],
        core_vs_ref=[rel_l2(core[i], ref.core[i]) for i in range(n)],
        core_vs_isolated=[rel_l2(core[i], iso_core[i]) for i in range(n)],
        parents_agree=agree, notes=notes)
