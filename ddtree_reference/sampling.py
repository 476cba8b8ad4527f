"""Sampling at temperature > 0: the tempered distribution, a counter-based keyed uniform, the draw.

Contract
========

* :class:`Sampling` holds the parameters (temperature T, top-k, top-p, seed, keying) and checks
  them: T < 0, top-p outside (0, 1], top-k < 0 or a keying other than :data:`KEYINGS` are a
  :class:`~ddtree_reference.errors.SamplingError`. ``T == 0`` is greedy (:attr:`Sampling.greedy`): the
  decoder then takes its greedy path, unchanged.
* :func:`tempered_probs` is *the* target distribution a lossless sampler must draw from, for logits
  ``[..., V]``: ``z = logits / T`` in float64; top-k keeps the k largest ``z`` (ties: lower token id
  first; ``0`` = off); softmax; top-p keeps the smallest prefix, in descending probability (ties:
  lower id first), whose mass reaches ``top_p`` (``1`` = off); renormalised. Float64 throughout so
  that an engine's and the reference's CDF boundaries differ only by the logits' own error.
* :func:`keyed_uniforms` is a counter-based generator: Philox-4x32-10 (Salmon et al., SC'11; the
  generator of cuRAND and of torch's CUDA RNG), key = the 64-bit seed, counter = four 32-bit words;
  one uniform in [0, 1) with 53 random bits per counter. A pure function of (seed, counter): the same
  numbers on any machine, CPU or GPU, in any order, with no global RNG state.
* Keying (:data:`KEYINGS`): ``"position"`` (the default) keys the draw that produces the token at
  sequence position ``q`` by ``(request, q)``: every node's draw is independent of every other
  draw the walk can consult (it consults one node per depth, and depths are distinct positions),
  and it is the *same* number target-only sampling uses for that position, so the tree decoder's
  output equals target-only sampling token for token (the lossless invariant, testable exactly).
  Siblings share a position and hence a uniform; the walk never consults two siblings, so this is
  harmless (docs/sampling.md). ``"node"`` keys by ``(request, step, node)``: independent numbers
  at every node, equal to target-only sampling in distribution only.
* :func:`inverse_cdf` draws: the first token, in token-id order, whose cumulative probability
  exceeds ``u * total`` (a zero-probability token is never drawn). :func:`boundary_margin` is the
  distance of ``u * total`` to the nearest CDF boundary: how far the logits could move before a
  replay of the same ``u`` draws another token.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import torch

from ddtree_reference.errors import SamplingError

__all__ = [
    "DOMAIN_NODE",
    "DOMAIN_PIT",
    "DOMAIN_POSITION",
    "KEYINGS",
    "Sampling",
    "boundary_margin",
    "inverse_cdf",
    "keyed_uniforms",
    "node_uniforms",
    "philox4x32",
    "request_key",
    "tempered_probs",
]

KEYINGS = ("position", "node")

#: the counter's last word: which use a number serves (so no two uses ever share a number)
DOMAIN_POSITION, DOMAIN_NODE, DOMAIN_PIT = 1, 2, 3

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
_MASK32 = np.uint64(0xFFFFFFFF)
_ROUNDS = 10


@dataclass(frozen=True, slots=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int = 0
    keying: str = "position"

    def __post_init__(self) -> None:
        t, p, k = self.temperature, self.top_p, self.top_k
        if not isinstance(t, (int, float)) or t != t or t < 0 or t == float("inf"):
            raise SamplingError(f"temperature must be a finite number >= 0, got {t!r}")
        if not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:  # also rejects NaN
            raise SamplingError(f"top-p must lie in (0, 1], got {p!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise SamplingError(f"top-k must be an integer >= 0 (0 = off), got {k!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**64:
            raise SamplingError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if self.keying not in KEYINGS:
            raise SamplingError(f"keying must be one of {KEYINGS}, got {self.keying!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_json(self) -> dict:
        return {"temperature": float(self.temperature), "top_k": int(self.top_k), "top_p": float(self.top_p),
                "seed": int(self.seed), "keying": self.keying}


def request_key(request_id: str) -> int:
    """The generator's request word for a request id: CRC-32 of its UTF-8 bytes (stable across runs,
    processes and prompt order, so parallel workers draw what one process draws)."""
    return zlib.crc32(request_id.encode("utf-8"))


# ------------------------------------------------------------------------------------ Philox
def philox4x32(counter: np.ndarray, seed: int) -> np.ndarray:
    """Philox-4x32-10 of ``counter`` ``[n, 4]`` (uint32 words) under the 64-bit ``seed``: ``[n, 4]`` uint32."""
    # uint64 holds every 32x32-bit product exactly; results are masked back to 32 bits.
    c = np.asarray(counter, dtype=np.uint64) & _MASK32  # [n, 4]
    c0, c1, c2, c3 = (c[:, i].copy() for i in range(4))
    k0 = np.uint64(seed & 0xFFFFFFFF)
    k1 = np.uint64((seed >> 32) & 0xFFFFFFFF)
    for r in range(_ROUNDS):
        if r:
            k0 = (k0 + _W0) & _MASK32
            k1 = (k1 + _W1) & _MASK32
        p0 = _M0 * c0
        p1 = _M1 * c2
        hi0, lo0 = p0 >> np.uint64(32), p0 & _MASK32
        hi1, lo1 = p1 >> np.uint64(32), p1 & _MASK32
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return np.stack([c0, c1, c2, c3], axis=1).astype(np.uint32)  # [n, 4]; values < 2**32: exact


def keyed_uniforms(seed: int, counters: np.ndarray | list) -> torch.Tensor:
    """One uniform in [0, 1) per counter row ``[n, 4]`` (53 random bits each): ``[n]`` float64."""
    arr = np.asarray(counters, dtype=np.int64).reshape(-1, 4)  # [n, 4]
    if arr.size and (arr.min() < 0 or arr.max() >= 2**32):
        raise SamplingError(f"counter words must lie in [0, 2**32), got {arr.min()}..{arr.max()}")
    out = philox4x32(arr, seed).astype(np.uint64)  # [n, 4]; widened so the shifts below cannot overflow
    bits = ((out[:, 0] >> np.uint64(5)) << np.uint64(26)) | (out[:, 1] >> np.uint64(6))  # 27 + 26 = 53 bits
    # float64 represents every 53-bit integer exactly: the uniform is bits / 2**53 exactly.
    return torch.from_numpy(bits.astype(np.float64) / float(2**53))


def node_uniforms(s: Sampling, request: int, step: int, positions: list[int] | torch.Tensor) -> torch.Tensor:
    """The uniform of each node of a verify step ``[N]`` float64 (``positions``: the sequence position
    each node's draw produces, = committed_len + depth + 1; ``step`` -1 = the prefill's draw)."""
    pos = [int(q) for q in (positions.tolist() if isinstance(positions, torch.Tensor) else positions)]
    if s.keying == "position":
        rows = [[request & 0xFFFFFFFF, q, 0, DOMAIN_POSITION] for q in pos]
    else:
        rows = [[request & 0xFFFFFFFF, step + 1, i, DOMAIN_NODE] for i in range(len(pos))]
    return keyed_uniforms(s.seed, rows)


# ------------------------------------------------------------------------------ distribution
def _stable_desc(x: torch.Tensor) -> torch.Tensor:
    """Indices sorting the last axis descending, ties by lower index first."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices


def tempered_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The sampling distribution of ``logits`` ``[..., V]`` (module docstring): ``[..., V]`` float64."""
    if temperature <= 0:
        raise SamplingError(f"tempered_probs needs temperature > 0, got {temperature}")
    # float64: sums over the whole vocabulary must not blur CDF boundaries (see module docstring)
    z = logits.detach().to(torch.float64) / float(temperature)
    V = z.shape[-1]
    if 0 < top_k < V:
        order = _stable_desc(z)
        drop = order[..., top_k:]
        z = z.scatter(-1, drop, float("-inf"))
    p = torch.softmax(z, dim=-1)
    if top_p < 1.0:
        order = _stable_desc(p)
        sp = p.gather(-1, order)
        before = torch.cumsum(sp, dim=-1) - sp  # mass strictly before each token in descending order
        keep_sorted = before < top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        p = torch.where(keep, p, torch.zeros_like(p))
        p = p / p.sum(dim=-1, keepdim=True)
    return p


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token drawn at each row of ``probs`` ``[N, V]`` with uniform ``u`` ``[N]``: ``[N]`` int64."""
    cdf = torch.cumsum(probs.to(torch.float64), dim=-1)  # [N, V]; float64: see tempered_probs
    x = (u.to(torch.float64) * cdf[:, -1]).unsqueeze(-1)  # [N, 1]
    tok = torch.searchsorted(cdf, x, right=True).squeeze(-1)  # first index with cdf > x
    last = probs.shape[-1] - 1 - torch.argmax((probs.flip(-1) > 0).to(torch.int8), dim=-1)  # last positive token
    return torch.minimum(tok, last)


def boundary_margin(probs: torch.Tensor, u: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Distance of ``u * total`` to the nearer CDF edge of ``tokens``' interval, per row: ``[N]`` float64."""
    cdf = torch.cumsum(probs.to(torch.float64), dim=-1)  # [N, V]
    x = u.to(torch.float64) * cdf[:, -1]
    hi = cdf.gather(-1, tokens[:, None]).squeeze(-1)
    lo = hi - probs.to(torch.float64).gather(-1, tokens[:, None]).squeeze(-1)
    return torch.minimum(x - lo, hi - x)
