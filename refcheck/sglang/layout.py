"""Conversions between SGLang's speculative-decoding tensors and refcheck's layouts (pure functions), shared by
the capture (:mod:`refcheck.sglang.capture`) and REFCHECK_DDTREE (:mod:`refcheck.sglang.ddtree`).

Contract (facts from SGLang 0.5.17 / 0.5.23 source, see docs/sglang-capture.md):

* Tree: node 0 is the root and parents precede children; ``retrieve_next_token[p]`` is the
  smallest-index child of ``p`` and ``retrieve_next_sibling[c]`` the next child of the same parent in
  increasing index (-1 = none). :func:`parents_from_links` / :func:`links_from_parents` convert both
  ways; ``accept_index`` rows hold flattened node indices ``b*N + j`` padded with -1.
* Recurrent (SSM) state: SGLang ``[..., HV, V, K]``, refcheck/transformers ``[..., HV, K, V]``.
* Conv state: SGLang ``[conv_dim, K-1]`` (pre-conv inputs, oldest first), refcheck ``[K-1, conv_dim]``.
* KV: SGLang's per-layer buffer is indexed by token slot, ``[slots, H_kv, D]`` (post-norm, post-RoPE K);
  refcheck keeps ``[H_kv, P, D]`` per request.
* Tensor parallelism: heads (HV, KV heads) are split in contiguous blocks per rank; the conv channels
  of a rank are ``[q_shard, k_shard, v_shard]``, so the full ``[q, k, v]`` is re-assembled per group.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def parents_from_links(next_token: Sequence[int], next_sibling: Sequence[int]) -> list[int]:
    """[N] first-child / next-sibling links (node 0 = root) -> [N] parents (root -1)."""
    n = len(next_token)
    if len(next_sibling) != n:
        raise ValueError(f"next_token has {n} entries, next_sibling {len(next_sibling)}")
    parents = [-2] * n
    parents[0] = -1
    for p in range(n):  # parents precede children, so p is placed before its children are reached
        c, prev = int(next_token[p]), p
        while c != -1:  # children in increasing index, each after its parent
            if not prev < c < n or parents[c] != -2:
                raise ValueError(f"malformed tree links at node {c} (parent {p})")
            parents[c] = p
            c, prev = int(next_sibling[c]), c
    missing = [i for i, q in enumerate(parents) if q == -2]
    if missing:
        raise ValueError(f"nodes {missing} are not reachable from the root")
    return parents


def links_from_parents(parents: Sequence[int]) -> tuple[list[int], list[int]]:
    """[N] parents (parents[0] = -1, parents[i] < i) -> (next_token, next_sibling), SGLang's encoding."""
    n = len(parents)
    next_token, next_sibling = [-1] * n, [-1] * n
    last_child: dict[int, int] = {}
    for i in range(1, n):
        p = int(parents[i])
        if not -1 < p < i:
            raise ValueError(f"parents[{i}] = {p} is not an earlier node")
        if p in last_child:
            next_sibling[last_child[p]] = i
        else:
            next_token[p] = i
        last_child[p] = i
    return next_token, next_sibling


def depths_from_parents(parents: Sequence[int]) -> list[int]:
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[int(parents[i])] + 1
    return depth


def accepted_from_accept_index(row: Sequence[int], batch_row: int, n: int) -> list[int]:
    """One request's ``accept_index`` row (flattened ``b*N + j``, -1 padded) -> local node indices."""
    out = [int(i) - batch_row * n for i in row if int(i) >= 0]
    if any(not 0 <= j < n for j in out):
        raise ValueError(f"accept_index row {list(row)} is outside request {batch_row}'s {n} nodes")
    return out


def ssm_to_reference(state: torch.Tensor) -> torch.Tensor:
    """[..., HV, V, K] (SGLang) -> [..., HV, K, V] (refcheck / transformers)."""
    return state.transpose(-1, -2)


def conv_to_reference(conv: torch.Tensor) -> torch.Tensor:
    """[conv_dim, K-1] (SGLang) -> [K-1, conv_dim] (refcheck)."""
    return conv.transpose(-1, -2)


def kv_to_reference(buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """A layer's K or V buffer [slots_total, H_kv, D] and a request's token slots [P] -> [H_kv, P, D]."""
    return buffer[slots.long()].transpose(0, 1)


def gather_heads(shards: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """Re-assemble a head-sharded tensor (contiguous blocks of heads per rank) along ``dim``."""
    return torch.cat(list(shards), dim=dim)


def gather_conv_channels(shards: Sequence[torch.Tensor], key_dim: int, value_dim: int, dim: int = 0) -> torch.Tensor:
    """Conv state channels from TP ranks, each ``[q_r, k_r, v_r]`` along ``dim`` -> full ``[q, k, v]``."""
    tp = len(shards)
    kq, vv = key_dim // tp, value_dim // tp
    qs, ks, vs = zip(*(torch.split(s, [kq, kq, vv], dim=dim) for s in shards))
    return torch.cat([*qs, *ks, *vs], dim=dim)


def shard_conv_channels(full: torch.Tensor, key_dim: int, value_dim: int, tp: int, dim: int = 0) -> list[torch.Tensor]:
    """The inverse of :func:`gather_conv_channels` (what each TP rank holds), for tests and simulations."""
    q, k, v = torch.split(full, [key_dim, key_dim, value_dim], dim=dim)
    return [torch.cat([a, b, c], dim=dim) for a, b, c in zip(q.chunk(tp, dim), k.chunk(tp, dim), v.chunk(tp, dim))]
