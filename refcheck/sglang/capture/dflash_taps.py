"""Taps on SGLang's DFLASH drafter for one decode step: what it drafted and what it was fed; and its drafter faults.

Contract: :func:`dflash_taps` is a context manager around one call of ``DFlashWorkerV2.forward_batch_generation``.
While it is open, two instance-level wraps are in place (removed on exit):

* the draft model runner's ``forward``: after the draft block's forward, the draft hidden states of depths
  1..B-1 go through the target's LM head (the engine's own head and dtype, as SGLang's greedy draft does) and
  the batch's top ranks per depth are kept on the device (:func:`refcheck.sglang.draft_side.draft_top`,
  :attr:`DFlashTaps.draft`); where SGLang's draft returns no hidden states, nothing is kept and
  :attr:`DFlashTaps.missing` says why;
* ``_append_target_hidden_to_draft_kv_by_loc``: the target features the step feeds the drafter's KV, sketched
  on the device, with their positions and each request's count of rows (its first ``commit_lens[b]`` rows of
  the verify block), are kept (:attr:`DFlashTaps.context`).

Nothing is copied to the host here: the plugin ships the kept tensors with the step's record.

``REFCHECK_DRAFT_FAULT`` (:data:`FAULTS`; opt-in, for refcheck's selftest, recorded in the provenance) injects a
drafter fault into SGLang's DFLASH through the same wraps, while the taps keep what SGLang used:

* ``context-positions-shifted``: the drafter's context is written at each token's position + 1;
* ``context-skip-last``: a decode step writes all committed rows but the last (its features are left out);
* ``context-layers-swapped``: the first two target layers' feature blocks are fed in swapped order;
* ``draft-depth-shift``: depth d proposes the greedy token of depth d - 1 (depth 1 keeps its own): the
  drafter's output read one position off.

Each leaves the output lossless and lowers τ. No SGLang import: the worker is passed in.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from refcheck.sglang.capture.graphs import GraphCache
from refcheck.sglang.capture.graphs import run as graphs_run
from refcheck.sglang.capture.packing import Packed, prepack
from refcheck.sglang.draft_side import DRAFT_TOPK, draft_top
from refcheck.sketch import sketch_on_device

ENV_FAULT = "REFCHECK_DRAFT_FAULT"
FAULTS = ("context-positions-shifted", "context-skip-last", "context-layers-swapped", "draft-depth-shift")


class DraftFaultError(ValueError):
    """``REFCHECK_DRAFT_FAULT`` names no fault."""


def active() -> str | None:
    """The drafter fault this process injects (None: none); an unknown name is refused."""
    name = os.environ.get(ENV_FAULT) or None
    if name is not None and name not in FAULTS:
        raise DraftFaultError(f"{ENV_FAULT}={name!r} is not a drafter fault (faults: {', '.join(FAULTS)})")
    return name


@dataclass
class DFlashTaps:
    #: the batch's draft top ranks (:func:`draft_top`: ids, logprobs [bs, B-1, K2], reach [bs, B-1]), on the device,
    #: packed (:class:`~refcheck.sglang.capture.packing.Packed`: one buffer, the graph's output)
    draft: Packed | None = None
    #: the drafter's context: sketch [bs, B, r], positions [bs, B], lens [bs] (rows fed per request), on the device,
    #: packed
    context: Packed | None = None
    missing: str | None = None  # why no draft top-k was kept
    host_s: float = 0.0  # the taps' own time on the scheduler's thread (inside the engine's step)


def _head_weight(worker: Any) -> torch.Tensor:
    model = worker.target_worker.model_runner.model
    vocab = int(worker.target_worker.model_runner.model_config.vocab_size)
    return model.lm_head.weight[:vocab]  # [V, H]: padded vocabulary rows dropped


def _swap_first_layers(hidden: torch.Tensor, n_layers: int) -> torch.Tensor:
    """[n, n_ids*H] with the first two H-wide feature blocks swapped."""
    if n_layers < 2:
        return hidden
    h = hidden.shape[-1] // n_layers
    out = hidden.clone()
    out[:, :h], out[:, h:2 * h] = hidden[:, h:2 * h], hidden[:, :h]
    return out


def _context(target_hidden: torch.Tensor, positions: torch.Tensor, commit_lens: torch.Tensor, bs: int) -> dict:
    """The drafter's context of a decode step, on the device: feature sketch [bs, B, r], positions [bs, B], lens."""
    rows = target_hidden.view(bs, -1, target_hidden.shape[-1])  # [bs*B, F] -> [bs, B, F]
    sketch = sketch_on_device(rows)  # [bs, B, r]
    return {"sketch": sketch, "positions": positions.view(bs, -1).clone(), "lens": commit_lens.clone()}  # [bs*B] -> [bs, B]


def draft_logits(hidden: torch.Tensor, head: torch.Tensor, bs: int, block: int) -> torch.Tensor:
    """The draft block's hidden states [bs*B, H] of depths 1..B-1 through the target's head [V, H]: [bs, B-1, V]
    logits, in the head's dtype (as the engine's greedy draft computes them). One 2-D product over every request's
    rows, which reads the head once; the strided 3-D product of the depths' view would be a batched one that reads
    the whole head again for each request (at a 248k x 5120 head, 2.5 GB a request)."""
    # [bs*B, H] -> [bs, B-1, H] -> [bs*(B-1), H]: depths 1..B-1, copied contiguous; cast to the head's dtype (the
    # engine's greedy draft multiplies in it)
    hs = hidden.view(bs, block, -1)[:, 1:, :].reshape(bs * (block - 1), -1).to(head.dtype)
    return torch.matmul(hs, head.T).view(bs, block - 1, -1)  # [bs*(B-1), V] -> [bs, B-1, V]


def _draft(hidden: torch.Tensor, head: torch.Tensor, bs: int, block: int) -> dict[str, torch.Tensor]:
    """The top ranks of the draft's depths 1..B-1 (:func:`draft_top` of :func:`draft_logits`)."""
    return draft_top(draft_logits(hidden, head, bs, block), DRAFT_TOPK)


def _shapes(*ts: torch.Tensor) -> tuple:
    return tuple((tuple(t.shape), t.dtype) for t in ts)


def _shift_depths(worker: Any, out: Any, hidden: torch.Tensor | None, bs: int, block: int) -> None:
    """``draft-depth-shift``: depth d proposes depth d - 1's greedy token (the graphed draft's sampled tokens, else
    the eager draft's hidden states, shifted in place)."""
    sampler = getattr(worker, "_draft_sampler", None)
    if sampler is not None and getattr(out, "can_run_graph", False):
        tokens = sampler.out[: bs * (block - 1)].view(bs, block - 1)  # [bs*(B-1)] -> [bs, B-1]
        tokens[:, 1:] = tokens[:, :-1].clone()
    elif hidden is not None:
        hv = hidden.view(bs, block, -1)  # [bs*B, H] -> [bs, B, H]
        hv[:, 2:] = hv[:, 1:-1].clone()


def _fed(fault: str | None, target_hidden: torch.Tensor, positions: torch.Tensor, commit_lens: torch.Tensor | None,
         n_ids: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What the drafter's KV is fed under a context fault (as it is without one)."""
    if fault == "context-positions-shifted":
        positions = positions + 1
    elif fault == "context-skip-last" and commit_lens is not None:
        commit_lens = (commit_lens - 1).clamp(min=0)
    elif fault == "context-layers-swapped":
        target_hidden = _swap_first_layers(target_hidden, n_ids)
    return target_hidden, positions, commit_lens


def _keeping(taps: DFlashTaps, part: str, keep: Callable[[], Any]) -> Any:
    """``keep()``, its time added to the taps' host time. It runs inside SGLang's step: a failure leaves the part
    missing, says why (``taps.missing``), and the step goes on."""
    t0 = time.perf_counter()
    try:
        return keep()
    except Exception as exc:  # noqa: BLE001 - never into SGLang's forward
        taps.missing = f"the drafter's {part} could not be kept ({type(exc).__name__}: {exc})"
        return None
    finally:
        taps.host_s += time.perf_counter() - t0


def _draft_of(worker: Any, hidden: torch.Tensor, bs: int, block: int, graphs: GraphCache | None) -> dict:
    """The draft block's top ranks (:func:`_draft`) through the target's head, from the graph cache when given."""
    w = _head_weight(worker)
    return graphs_run(graphs, ("draft", bs, block, w.data_ptr(), _shapes(hidden)),
                      lambda h: prepack(_draft(h, w, bs, block)), hidden)


@contextlib.contextmanager
def dflash_taps(worker: Any, bs: int, record: bool, fault: str | None,
                graphs: tuple[GraphCache, GraphCache] | None = None) -> Iterator[DFlashTaps]:
    """Open the taps (module docstring) for one ``forward_batch_generation`` of a batch of ``bs`` requests;
    ``record``: keep what the drafter produced and consumed (a traced decode step); ``graphs``: replay the draft's
    and the context's device work from CUDA graphs kept in these two caches (:mod:`refcheck.sglang.capture.graphs`:
    one cache each, as both are replayed in one step)."""
    draft_graphs, context_graphs = graphs if graphs is not None else (None, None)
    taps = DFlashTaps()
    try:
        runner = worker.draft_model_runner
        forward = runner.forward
        append = worker._append_target_hidden_to_draft_kv_by_loc
        block = int(worker.block_size)
        n_ids = int(getattr(getattr(runner, "model", None), "num_context_features", 1) or 1)  # target layers fed
    except (AttributeError, TypeError, ValueError) as exc:  # another SGLang's DFLASH: nothing to tap, the step
        if fault is not None:  # runs as SGLang has it
            raise
        taps.missing = f"this SGLang's DFLASH worker has no draft runner, drafter-KV writer or block size to tap ({exc})"
        yield taps
        return
    own_forward = "forward" in vars(runner)  # an instance attribute to put back, else the class's method

    def draft_forward(*args: Any, **kwargs: Any) -> Any:
        out = forward(*args, **kwargs)
        hidden = getattr(getattr(out, "logits_output", None), "hidden_states", None)
        if record and hidden is not None:
            taps.draft = _keeping(taps, "draft", lambda: _draft_of(worker, hidden, bs, block, draft_graphs))
        elif record:
            taps.missing = "SGLang's DFLASH draft forward returned no hidden states"
        if fault == "draft-depth-shift":
            _shift_depths(worker, out, hidden, bs, block)
        return out

    def feed(*, target_hidden: torch.Tensor, cache_loc: torch.Tensor, positions: torch.Tensor,
             cache_loc_2d: torch.Tensor | None = None, commit_lens: torch.Tensor | None = None) -> Any:
        target_hidden, positions, commit_lens = _fed(fault, target_hidden, positions, commit_lens, n_ids)
        if record and commit_lens is not None:
            taps.context = _keeping(taps, "context", lambda: graphs_run(
                context_graphs, ("context", bs, _shapes(target_hidden, positions, commit_lens)),
                lambda th, pos, lens: prepack(_context(th, pos, lens, bs)), target_hidden, positions, commit_lens))
        return append(target_hidden=target_hidden, cache_loc=cache_loc, positions=positions, cache_loc_2d=cache_loc_2d,
                      commit_lens=commit_lens)

    runner.forward = draft_forward
    worker._append_target_hidden_to_draft_kv_by_loc = feed
    try:
        yield taps
    finally:
        if own_forward:
            runner.forward = forward
        else:
            del runner.forward
        del worker._append_target_hidden_to_draft_kv_by_loc
