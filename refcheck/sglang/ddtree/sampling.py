"""REFCHECK_DDTREE at temperature > 0: refcheck's keyed, lossless tree sampler inside SGLang.

Contract. SGLang's own tree sampler (``eagle_sample`` -> ``tree_speculative_sampling_target_only``)
draws from torch's global generator and exposes nothing, so a run of it can only be judged
statistically. REFCHECK_DDTREE instead samples exactly as refcheck's reference decoder does
(docs/sampling.md), so that its runs replay *exactly*:

* every node draws one token from the target's tempered distribution at its prefix
  (:func:`ddtree_reference.sampling.tempered_probs`: ``logits / T``, top-k, top-p, in float64), by the
  inverse CDF of a Philox uniform keyed by (seed, request word, position the draw produces)
  (:func:`ddtree_reference.sampling.node_uniforms`, keying ``"position"``);
* the walk starts at the root and moves to the child whose token equals the node's draw while one
  exists; the bonus is the draw at the last accepted node; the first token after the prefill is the
  draw at position ``len(prompt)`` (:func:`first_token`).

:func:`request_keys` reads a request's parameters from SGLang's ``SamplingParams``: temperature,
top-k (SGLang's "off" is ``-1`` or ``TOP_K_ALL``), top-p, and refcheck's keys from
``custom_params`` (``refcheck_seed``, ``refcheck_request``: the runner sets them; without them the
seed is ``sampling_seed`` or 0 and the request word CRC-32 of the rid). A greedy request (SGLang
normalises temperature 0 to temperature 1 with top-k 1) gives None. Sampling features the keyed
sampler does not implement (penalties, min-p, logit bias) are refused (:class:`ValueError`, which
SGLang reports) rather than silently ignored.

:func:`sample_tree` is the algorithm on flat SGLang tensors (no SGLang import: CPU-testable);
:func:`keyed_sample` adapts it to ``eagle_sample``'s call and returns ``eagle_sample``'s three
outputs plus every node's draw and uniform (``-1`` / NaN at greedy requests' nodes), which
refcheck's capture hook records. The worker calls it through this module's attribute so the hook
sees it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ddtree_reference.sampling import Sampling, inverse_cdf, node_uniforms, request_key, tempered_probs
from ddtree_reference.tree import Tree
from refcheck.sglang.layout import depths_from_parents, parents_from_links

#: SGLang's "top-k off" (sampling_params.TOP_K_ALL); -1 is what clients send
TOP_K_OFF = (-1, 1 << 30)
#: the custom_params keys refcheck's runner sets on every request it sends
SEED_KEY, REQUEST_KEY = "refcheck_seed", "refcheck_request"


@dataclass(frozen=True, slots=True)
class RequestKeys:
    """A sampled request's distribution parameters and the key of its uniforms."""

    sampling: Sampling
    request: int  # the generator's request word (CRC-32 of the trace's request id)


def is_greedy(params: Any) -> bool:
    """SGLang normalises a request's temperature 0 to temperature 1 with top_k 1, so greedy is either."""
    return float(params.temperature) < 1e-6 or int(getattr(params, "top_k", -1)) == 1


def unsupported(params: Any) -> list[tuple[str, Any]]:
    """(name, value) of each SGLang sampling param a request sets beyond temperature, top-k and top-p that changes
    the distribution it draws from: the penalties, ``min_p`` and a logit bias."""
    out: list[tuple[str, Any]] = []
    for name, neutral in (("frequency_penalty", 0.0), ("presence_penalty", 0.0), ("repetition_penalty", 1.0),
                          ("min_p", 0.0)):
        v = getattr(params, name, neutral)
        if v is not None and float(v) != neutral:
            out.append((name, v))
    if getattr(params, "logit_bias", None):
        out.append(("logit_bias", None))
    return out


def distribution_of(params: Any, seed: int = 0) -> Sampling:
    """A request's SGLang sampling params as refcheck's :class:`Sampling` (SGLang's top-k off is refcheck's 0); a
    :class:`~ddtree_reference.errors.SamplingError` for values refcheck's sampler refuses."""
    k = int(getattr(params, "top_k", -1))
    return Sampling(float(params.temperature), 0 if k in TOP_K_OFF else k, float(getattr(params, "top_p", 1.0)), seed)


def request_keys(rid: str, params: Any) -> RequestKeys | None:
    """The keyed sampler's parameters of one request (module docstring); None when it is greedy."""
    if is_greedy(params):
        return None
    bad = unsupported(params)
    if bad:
        asked = ", ".join(name if value is None else f"{name} {value}" for name, value in bad)
        raise ValueError(f"REFCHECK_DDTREE samples with temperature, top-k and top-p only; request {rid} also asks for "
                         f"{asked}, which its keyed sampler does not implement")
    custom = getattr(params, "custom_params", None) or {}
    seed = custom.get(SEED_KEY, getattr(params, "sampling_seed", None) or 0)
    word = custom.get(REQUEST_KEY, request_key(str(rid)))
    return RequestKeys(distribution_of(params, int(seed)), int(word))


def _draws(logits: torch.Tensor, keys: RequestKeys, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each node's draw ``[n]`` int64 and uniform ``[n]`` float64 (host) from its logits ``[n, V]``."""
    s = keys.sampling
    probs = tempered_probs(logits, s.temperature, s.top_k, s.top_p)  # [n, V] float64, on the logits' device
    u = node_uniforms(s, keys.request, 0, positions)  # keying "position": the step index is not used
    return inverse_cdf(probs, u.to(probs.device)).cpu(), u


def _tree(tokens: list[int], next_token: list[int], next_sibling: list[int]) -> Tree:
    """One request's tree from SGLang's first-child / next-sibling links (no drafter ranks or scores)."""
    parents = parents_from_links(next_token, next_sibling)
    n = len(tokens)
    return Tree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths_from_parents(parents)),
                torch.zeros(n, dtype=torch.long), torch.zeros(n))


def sample_tree(logits: torch.Tensor, candidates: torch.Tensor, next_token: torch.Tensor, next_sibling: torch.Tensor,
                keys: list[RequestKeys | None], roots: list[int], width: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One verify step of a batch. ``logits`` ``[bs*N, V]``, ``candidates`` / links ``[bs, N]`` (local node
    indices, -1 = none), ``keys`` per request (None = greedy: the argmax walk), ``roots`` each request's
    root position (committed length). Returns ``eagle_sample``'s ``predict`` ``[bs*N]`` int32, ``accept_lens``
    ``[bs]`` int32 (bonus counted), ``accept_index`` ``[bs, width]`` int32 (flat indices, -1 padded), and
    ``draws`` ``[bs*N]`` int64 / ``uniforms`` ``[bs*N]`` float64 (-1 / NaN at greedy requests' nodes)."""
    bs, n = int(candidates.shape[0]), int(candidates.shape[1])
    toks, nt, ns = candidates.cpu().tolist(), next_token.cpu().tolist(), next_sibling.cpu().tolist()
    predict = torch.zeros(bs * n, dtype=torch.int32)
    accept_index = torch.full((bs, width), -1, dtype=torch.int32)
    accept_lens = torch.zeros(bs, dtype=torch.int32)
    draws = torch.full((bs * n,), -1, dtype=torch.int64)
    uniforms = torch.full((bs * n,), float("nan"), dtype=torch.float64)
    for b in range(bs):
        tree = _tree(toks[b], nt[b], ns[b])
        rows = logits[b * n:(b + 1) * n]  # [N, V]
        if keys[b] is None:
            drawn = rows.argmax(dim=-1).cpu()  # what SGLang's greedy verify takes
        else:
            drawn, u = _draws(rows, keys[b], (roots[b] + 1 + tree.depths).tolist())
            draws[b * n:(b + 1) * n], uniforms[b * n:(b + 1) * n] = drawn, u
        path = tree.walk_greedy(drawn)  # the reference's walk: the child equal to each node's draw
        for j in path:
            predict[b * n + j] = int(drawn[j])
        accept_index[b, : len(path)] = torch.tensor([b * n + j for j in path], dtype=torch.int32)
        accept_lens[b] = len(path)
    return predict, accept_lens, accept_index, draws, uniforms


def keyed_sample(verify_input: Any, batch: Any, logits_output: Any, keys: list[RequestKeys | None]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``eagle_sample``'s call for a batch with sampled requests (``keys`` per request, None = greedy):
    its ``predict``, ``accept_lens``, ``accept_index`` on the batch's device, then ``draws`` and
    ``uniforms`` (host) for refcheck's capture."""
    n = int(verify_input.draft_token_num)
    bs = len(batch.reqs)
    logits = logits_output.next_token_logits  # [bs*N, V]
    candidates = verify_input.draft_token.reshape(bs, n)  # [bs*N] -> [bs, N]
    roots = [len(r.origin_input_ids) + len(r.output_ids) - 1 for r in batch.reqs]  # committed length = root position
    predict, lens, index, draws, uniforms = sample_tree(logits, candidates, verify_input.retrieve_next_token,
                                                        verify_input.retrieve_next_sibling, keys, roots, n)
    dev = logits.device
    return predict.to(dev), lens.to(dev), index.to(dev), draws, uniforms


def first_token(logits: torch.Tensor, keys: RequestKeys, prompt_len: int) -> tuple[int, float]:
    """The draw after the prefill from the last prompt position's logits ``[V]``: (token, uniform)."""
    tok, u = _draws(logits.reshape(1, -1), keys, [prompt_len])  # [V] -> [1, V]
    return int(tok[0]), float(u[0])
