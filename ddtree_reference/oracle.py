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

  both take a ``guess`` (an engine's output): one forward of prompt + guess gives the row of every
  prefix of it at once (a causal model's position q sees tokens <= q only), and a prefix's token is
  taken from that row where it is decided by more than :data:`GUESS_MARGIN` (logit top-two margin)
  or :data:`GUESS_CDF_MARGIN` (distance of the draw to its CDF edge). The rows of a longer forward
  differ from a prefix's own forward by float rounding alone (1.5e-5 of a logit at most on the
  built-in targets in fp32, 900 tokens); each guess measures it again on two prefixes of its own
  (the prompt and the half-way point) and is used only when that deviation is below the margins /
  :data:`GUESS_SAFETY`, so the margins decide the same token as the prefix's own forward on any
  model and device. A prefix the long forward does not settle is decided by its own forward; from
  the first one whose token leaves the guess, the next guess (or the plain loop) goes on. A correct
  engine's output is settled in three forwards instead of one per token; the result is the loop's;
* :func:`path_logits` — every tree node's logits obtained by running committed tokens + the
  node's root-to-node path as one plain sequence (each path on its own copy of the state, by
  construction, since nothing is cached).

Cost is quadratic in the sequence length; that is the price of independence and is fine for the
built-in models and for spot checks on real ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ddtree_reference.compat import full_forward_logits
from ddtree_reference.errors import SamplingError
from ddtree_reference.sampling import Sampling, boundary_margin, inverse_cdf, node_uniforms, tempered_probs

#: a guessed prefix's greedy token is taken from the long forward only above this top-two logit margin
GUESS_MARGIN = 1e-2
#: ... and a sampled one only where its draw is this far (in probability) from its CDF edge (nearer, the prefix's
#: own forward decides that draw and the guess goes on after it)
GUESS_CDF_MARGIN = 1e-2
#: a guess is used only where its long forward's rows are within margin / GUESS_SAFETY of the prefixes' own
GUESS_SAFETY = 20.0


def _guess_rows(model: torch.nn.Module, prompt_ids: list[int], guess: list[int]) -> tuple[torch.Tensor, float]:
    """Logits [len(guess), V] of the next token after prompt + guess[:j], j = 0..len(guess)-1, from one
    forward, and the largest logit difference of two of those rows (j = 0 and j = len(guess) // 2) from
    their prefixes' own forwards: the rounding a longer forward adds, measured."""
    device = next(model.parameters()).device
    seq = list(prompt_ids) + list(guess[:-1])
    rows = full_forward_logits(model, torch.tensor(seq, device=device))[len(prompt_ids) - 1 :]  # [G, V]
    probes = sorted({0, len(guess) // 2} - {len(guess) - 1})  # (the last row is the long forward's own)
    drift = max((float((full_forward_logits(model, torch.tensor(seq[: len(prompt_ids) + j], device=device))[-1]
                        - rows[j]).abs().max()) for j in probes), default=0.0)
    return rows, drift


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
    guesses: Sequence[Sequence[int]] = (),
) -> tuple[list[int], list[float]]:
    """Target-only sampled continuation of ``prompt_ids`` and each draw's boundary margin (``guesses``: the
    continuations expected, each settled in one forward where it holds and where it extends what the ones
    before it settled; module docstring)."""
    if sampling.greedy or sampling.keying != "position":
        raise SamplingError("sample_decode needs temperature > 0 and the 'position' keying")
    device = next(model.parameters()).device
    seq = list(prompt_ids)
    out: list[int] = []
    margins: list[float] = []

    def draw(logits: torch.Tensor, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and edge distances of the draws at ``positions`` from their rows ``logits`` [n, V]."""
        probs = tempered_probs(logits.cpu(), sampling.temperature, sampling.top_k, sampling.top_p)  # [n, V]
        u = node_uniforms(sampling, request, -1, positions)
        tok = inverse_cdf(probs, u)
        return tok, boundary_margin(probs, u, tok)

    for guess in guesses:
        g = list(guess)[:max_new_tokens]
        if len(g) <= len(out) or g[: len(out)] != out:
            continue  # empty, nothing new, or not a continuation of what is settled
        rows, drift = _guess_rows(model, list(prompt_ids), g)
        # a CDF edge moves by at most sum |dp| <= 2 max |d logit| / T (to first order)
        if GUESS_SAFETY * 2.0 * drift / sampling.temperature >= GUESS_CDF_MARGIN:
            continue
        at = list(range(len(out), len(g)))
        toks, edge = draw(rows[at], [len(prompt_ids) + j for j in at])
        for k, j in enumerate(at):
            tok, margin = int(toks[k]), float(edge[k])
            if tok != g[j] or margin <= GUESS_CDF_MARGIN:  # not settled by the long forward: the prefix's own
                t1, m1 = draw(full_forward_logits(model, torch.tensor(seq, device=device))[-1:], [len(seq)])
                tok, margin = int(t1[0]), float(m1[0])
            out.append(tok)
            margins.append(margin)
            seq.append(tok)
            if tok in stop_token_ids:
                return out, margins
            if tok != g[j]:
                break  # the guess leaves the oracle here: the next guess, or the loop, goes on from this prefix
    while len(out) < max_new_tokens:
        tok, edge = draw(full_forward_logits(model, torch.tensor(seq, device=device))[-1:], [len(seq)])  # [1, V] row
        margins.append(float(edge[0]))
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
        self._learned: set[tuple[int, ...]] = set()
        self.forwards = 0

    @torch.no_grad()
    def learn(self, prompt_ids: list[int], guess: list[int]) -> None:
        """Remember the next token after prompt + guess[:j] for every j the one forward of prompt +
        guess settles (top-two margin over :data:`GUESS_MARGIN`; module docstring)."""
        whole = tuple(prompt_ids) + tuple(guess)
        if not guess or whole in self._learned:
            return
        self._learned.add(whole)
        rows, drift = _guess_rows(self.model, prompt_ids, guess)  # [G, V]
        self.forwards += 1 + len({0, len(guess) // 2} - {len(guess) - 1})
        if GUESS_SAFETY * drift >= GUESS_MARGIN:
            return  # the long forward's rounding is too large to settle anything here: the loop decides
        top = rows.topk(2, dim=-1)
        seq = tuple(prompt_ids)
        for j in range(len(guess)):
            key = seq + tuple(guess[:j])
            if key not in self._next and float(top.values[j, 0] - top.values[j, 1]) > GUESS_MARGIN:
                self._next[key] = int(top.indices[j, 0])

    @torch.no_grad()
    def decode(self, prompt_ids: list[int], max_new_tokens: int,
               stop_token_ids: frozenset[int] | set[int] = frozenset(),
               guesses: Sequence[Sequence[int]] = ()) -> list[int]:
        """``greedy_decode``'s continuation; ``guesses`` (the continuations expected) are settled first, one
        forward per guess (:meth:`learn`)."""
        for g in guesses:  # (an empty one settles nothing)
            self.learn(list(prompt_ids), list(g)[:max_new_tokens])
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
