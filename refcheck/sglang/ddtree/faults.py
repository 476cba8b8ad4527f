"""Engine faults injected into SGLang itself, through ``REFCHECK_DDTREE``'s worker (pure torch; no SGLang).

Contract: each fault is registered as its own speculative algorithm, ``REFCHECK_DDTREE_FAULT_<NAME>``
(``ALGORITHMS`` maps the algorithm name to the fault's key), running the correct worker with one
step of SGLang's tree verify fed a wrong index, as a real engine bug would:

* ``mamba-flat-index`` (``REFCHECK_DDTREE_FAULT_MAMBA_FLAT_INDEX``): ``commit_mamba_states_after_verify``
  gets the chain's accept index (request ``b``'s ``j``-th accepted entry = flat node ``b*N + j``), so the
  conv/recurrent state of flat node ``accept_len - 1`` is committed instead of the last accepted node's.
  Acts at the first step whose last accepted node is not flat node ``accept_len - 1``.
* ``kv-move-last`` (``..._KV_MOVE_LAST``): ``move_accept_tokens_to_target_kvcache`` skips the last
  accepted node (its entry is made a move of slot ``accept_len - 1`` onto itself, a no-op), so the
  committed row ``seq_len + accept_len - 1`` keeps what the verify wrote there: flat node
  ``accept_len - 1``'s KV. Acts where ``mamba-flat-index`` does; attention layers only.
* ``flat-positions`` (``..._FLAT_POSITIONS``): the verify's positions are ``seq_len + j`` for flat node
  ``j`` instead of ``seq_len + depth(j)``. Acts at the first node whose flat index differs from its
  depth (the second child of the root, in DDTree's order), at the first decode step.
* ``bonus-neighbour`` (``..._BONUS_NEIGHBOUR``): request ``b``'s bonus token is the argmax of the
  next request's (``(b+1) % bs``) logits row at the same local node instead of its own. Needs at least
  two requests in one batch (with one request the neighbour is itself: no fault). SGLang's per-step
  record (its ``eagle_sample`` output, which refcheck's capture reads) is right; the token the engine
  emits, and the next step's root, are not.

Drafter faults (output lossless, acceptance lowered; caught in ``draft`` or ``tree`` at the first decode step):

* ``draft-positions-shifted``: the drafter's context is written at positions one past the tokens' own
  (prefill and every step), as a drafter fed ``seq_len + j + 1`` would be;
* ``draft-skip-last``: each step feeds the drafter the root and the accepted nodes except the last accepted
  one (its target features are left out of the context);
* ``draft-wrong-layers``: the drafter reads the target hidden states after the layers one past its
  ``target_layer_ids`` (the wrong capture layers);
* ``draft-depth-shift``: the tree is built with depth d's draft taken from the row of depth d + 1 (the
  drafter's output read one position off); the recorded draft is the drafter's own.

Sampler faults (temperature > 0; output and acceptance look plausible; caught by the ``temperature`` check):

* ``temperature-high`` / ``temperature-low``: the keyed sampler draws every node (and the first token) at 1.1 x /
  0.9 x the request's temperature, while the tree is still built at the request's (a sampler handed a
  temperature scaled twice, or a stale one); each changed draw alone lies within bf16 rounding at its node.

The functions below compute the faulty indices (and sampler keys) from SGLang's tensors; the worker applies them.
"""

from __future__ import annotations

import dataclasses

import torch

from refcheck.sglang.ddtree.sampling import RequestKeys

PREFIX = "REFCHECK_DDTREE_FAULT_"
VERIFY_FAULTS = ("mamba-flat-index", "kv-move-last", "flat-positions", "bonus-neighbour")
DRAFT_FAULTS = ("draft-positions-shifted", "draft-skip-last", "draft-wrong-layers", "draft-depth-shift")
SAMPLER_FAULTS = ("temperature-high", "temperature-low")
FAULTS = VERIFY_FAULTS + DRAFT_FAULTS + SAMPLER_FAULTS
#: sampler fault -> the factor its sampler applies to the request's temperature
TEMPERATURE_FACTOR: dict[str, float] = {"temperature-high": 1.1, "temperature-low": 0.9}


def algorithm_name(fault: str) -> str:
    """``mamba-flat-index`` -> ``REFCHECK_DDTREE_FAULT_MAMBA_FLAT_INDEX``."""
    return PREFIX + fault.upper().replace("-", "_")


#: SGLang algorithm name -> fault key
ALGORITHMS: dict[str, str] = {algorithm_name(f): f for f in FAULTS}

#: fault key -> the diff category of the first finding expected on a hybrid target (conv ranks before
#: recurrent; the neighbour's bonus shows as the next step's root, i.e. at the step after it acts)
EXPECTED: dict[str, str] = {"mamba-flat-index": "conv", "kv-move-last": "kv", "flat-positions": "logits",
                            "bonus-neighbour": "alignment", "draft-positions-shifted": "draft", "draft-skip-last": "draft",
                            "draft-wrong-layers": "draft", "draft-depth-shift": "tree", "temperature-high": "temperature",
                            "temperature-low": "temperature"}


def sampler_keys(keys: list[RequestKeys | None], fault: str | None) -> list[RequestKeys | None]:
    """The keys the sampler draws with: the requests' own, or with the temperature a sampler fault scales."""
    factor = TEMPERATURE_FACTOR.get(fault or "")
    if factor is None:
        return keys
    return [None if k is None else RequestKeys(dataclasses.replace(k.sampling, temperature=k.sampling.temperature * factor),
                                               k.request) for k in keys]


def chain_accept_index(accept_index: torch.Tensor, accept_lens: torch.Tensor, n: int) -> torch.Tensor:
    """[bs, W] accept index of a chain with the same lengths: entry (b, j) = b*n + j for j < accept_lens[b], else -1."""
    bs, width = accept_index.shape
    j = torch.arange(width, device=accept_index.device, dtype=accept_index.dtype)[None, :]
    base = (torch.arange(bs, device=accept_index.device, dtype=accept_index.dtype) * n)[:, None]
    inside = j < accept_lens.to(accept_index.device)[:, None].to(accept_index.dtype)
    return torch.where(inside, base + j, torch.full_like(accept_index, -1))


def skip_last_move(accept_index: torch.Tensor, accept_lens: torch.Tensor, n: int) -> torch.Tensor:
    """``accept_index`` with each request's last accepted entry replaced by its own target slot's flat
    node (b*n + accept_lens[b] - 1): the KV move of that node becomes a no-op."""
    out = accept_index.clone()
    rows = torch.arange(out.shape[0], device=out.device)
    last = accept_lens.to(out.device).long() - 1
    out[rows, last] = (rows * n + last).to(out.dtype)
    return out


def flat_positions(positions: torch.Tensor, bs: int, n: int) -> torch.Tensor:
    """[bs*n] positions ``seq_len + j`` (j the flat index) from the verify's ``seq_len + depth(j)``."""
    root = positions.view(bs, n)[:, :1]  # node 0 is the root, at depth 0: its position is seq_len
    return (root + torch.arange(n, device=positions.device, dtype=positions.dtype)[None, :]).reshape(-1)


def neighbour_bonus(predict: torch.Tensor, accept_index: torch.Tensor, accept_lens: torch.Tensor,
                    logits: torch.Tensor, n: int) -> torch.Tensor:
    """``predict`` with each request's bonus (at its last accepted node) replaced by the argmax of the
    next request's logits row at the same local node; logits [bs*n, V]."""
    out = predict.clone()
    bs = accept_index.shape[0]
    rows = torch.arange(bs, device=accept_index.device)
    last = accept_index[rows, accept_lens.to(accept_index.device).long() - 1].long()  # [bs] flat index
    neighbour = (last + n) % (bs * n)
    out[last.to(out.device)] = logits[neighbour.to(logits.device)].argmax(-1).to(out.dtype).to(out.device)
    return out
