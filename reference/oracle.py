"""Slow oracles the reference is tested against: target-only greedy decoding and per-path verify.

Contract: both use only the transformers model's own, cache-free forward over a whole token
sequence, so they share no code (and no state handling) with the tree decoder:

* :func:`greedy_decode` — the lossless invariant: DDTree's greedy output must equal this, token
  for token, whatever the drafter proposes;
* :class:`GreedyMemo` — the same continuations, each distinct sequence's forward run once;
* :func:`sample_decode` — the lossless invariant at temperature > 0: target-only sampling, the
  token at position q drawn with the uniform keyed by (seed, request, q) ("position" keying), so
  DDTree's sampled output must equal it token for token; it also returns each draw's CDF-boundary
  margin, so a comparison can stop at a draw that the logits' round-off could flip;
* :func:`path_logits` — every tree node's logits obtained by running committed tokens + the
  node's root-to-node path as one plain sequence (each path on its own copy of the state, by
  construction, since nothing is cached).

Cost is quadratic in the sequence length; that is the price of independence and is fine for the
built-in models and for spot checks on real ones.
"""

from __future__ import annotations

import torch

from reference.compat import full_forward_logits
from reference.errors import SamplingError
from reference.sampling import Sampling, boundary_margin, inverse_cdf, node_uniforms, tempered_probs


@torch.no_grad()
def greedy_decode(
    model: torch.nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    stop_token_ids: frozenset[int] | set[int] = frozenset(),
) -> list[int]:
    """Target-only greedy continuation of ``prompt_ids`` (stops after emitting a stop token)."""
    device = next(model.parameters()).device
    seq = list(prompt_ids)
    out: list[int] = []
    while len(out) < max_new_tokens:
        logits = full_forward_logits(model, torch.tensor(seq, device=device))
        tok = int(logits[-1].argmax())
        out.append(tok)
        seq.append(tok)
        if tok in stop_token_ids:
            break
    return out


@torch.no_grad()
def sample_decode(
    model: torch.nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: Sampling,
    request: int = 0,
    stop_token_ids: frozenset[int] | set[int] = frozenset(),
) -> tuple[list[int], list[float]]:
    """Target-only sampled continuation of ``prompt_ids`` and each draw's boundary margin."""
    if sampling.greedy or sampling.keying != "position":
        raise SamplingError("sample_decode needs temperature > 0 and the 'position' keying")
    device = next(model.parameters()).device
    seq = list(prompt_ids)
    out: list[int] = []
    margins: list[float] = []
    while len(out) < max_new_tokens:
        logits = full_forward_logits(model, torch.tensor(seq, device=device))[-1:]  # [1, V]
        probs = tempered_probs(logits.cpu(), sampling.temperature, sampling.top_k, sampling.top_p)  # [1, V]
        u = node_uniforms(sampling, request, -1, [len(seq)])
        tok = inverse_cdf(probs, u)
        margins.append(float(boundary_margin(probs, u, tok)[0]))
        out.append(int(tok[0]))
        seq.append(int(tok[0]))
        if out[-1] in stop_token_ids:
            break
    return out, margins


class GreedyMemo:
    """:func:`greedy_decode` with every next-token lookup remembered by its exact token sequence.

    ``decode(ids, n, stop)`` returns what ``greedy_decode(model, ids, n, stop)`` returns: the same
    loop, where the plain forward of a sequence seen before is not run again (a forward is a pure
    function of the sequence for fixed weights). Valid only while the model's weights and hooks stay
    as they are; meant for the oracle and the scripted drafter of one diff session, whose calls
    revisit the same greedy prefixes many times. ``forwards`` counts the forwards it ran.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._next: dict[tuple[int, ...], int] = {}
        self.forwards = 0

    @torch.no_grad()
    def decode(self, prompt_ids: list[int], max_new_tokens: int,
               stop_token_ids: frozenset[int] | set[int] = frozenset()) -> list[int]:
        device = next(self.model.parameters()).device
        seq = list(prompt_ids)
        out: list[int] = []
        while len(out) < max_new_tokens:
            key = tuple(seq)
            tok = self._next.get(key)
            if tok is None:
                tok = self._next[key] = int(full_forward_logits(self.model, torch.tensor(seq, device=device))[-1].argmax())
                self.forwards += 1
            out.append(tok)
            seq.append(tok)
            if tok in stop_token_ids:
                break
        return out


@torch.no_grad()
def path_logits(
    model: torch.nn.Module, committed: list[int], tokens: list[int], parents: list[int]
) -> torch.Tensor:
    """Logits of every tree node, each from a plain forward of committed + its path: [N, V] fp32."""
    device = next(model.parameters()).device
    rows = []
    for i in range(len(tokens)):
        path, j = [], i
        while j >= 0:
            path.append(tokens[j])
            j = parents[j]
        seq = torch.tensor(committed + path[::-1], device=device)
        rows.append(full_forward_logits(model, seq)[-1])
    return torch.stack(rows)
