"""A prefill record holds a request's first token only from the chunk that finishes its prompt: a long prompt runs
in several chunks (SGLang's ``--chunked-prefill-size``), and the token SGLang samples after a middle chunk is
thrown away. Where a chunk ends is read from the request as the release keeps it (0.5.17: ``extend_range``;
earlier: ``fill_ids``, :func:`refcheck.sglang.capture.versions.prefill_end`); a release that says neither is a
capture error, not a guess."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch
from capture_kit import V, make_batch, make_scheduler, read_capture  # tests/capture_kit.py

from refcheck.sglang.capture import hooks, versions


def _prefill(sched, batch, logits: torch.Tensor) -> None:
    hooks._run_batch(lambda self, b: NS(logits_output=NS(next_token_logits=logits), next_token_ids=logits.argmax(-1)),
                     sched, batch)


def _chunked(batch, row: int, end: int, shape: str) -> None:
    """Request ``row`` of ``batch`` gets a 10-token prompt of which this chunk fills ``end`` tokens."""
    req = batch.reqs[row]
    req.origin_input_ids = list(range(1, 11))
    if shape == "0.5.17":
        req.extend_range = NS(start=max(0, end - 4), end=end)
    else:  # a release before 0.5.17: the tokens filled through this chunk, no extend_range
        del req.extend_range
        req.fill_ids = req.origin_input_ids[:end]


@pytest.mark.parametrize("shape", ["0.5.17", "fill_ids"])
def test_a_long_prompts_middle_chunk_records_no_first_token_and_its_last_chunk_does(capture_dir, shape):
    """Request 1's 10-token prompt runs in chunks of 4: the chunks ending at 4 and 8 record nothing for it (request 0,
    whose 3-token prompt the first batch finishes, is recorded there); the chunk ending at 10 records request 1's
    first token, with its whole prompt as its context."""
    sched, *_ = make_scheduler()
    logits = [torch.randn(2, V, generator=torch.Generator().manual_seed(k)) for k in range(3)]
    first = make_batch("extend", True, [[], []])
    _chunked(first, 1, 4, shape)
    if shape == "fill_ids":
        del first.reqs[0].extend_range
        first.reqs[0].fill_ids = [1, 2, 3]
    _prefill(sched, first, logits[0])
    for k, end in ((1, 8), (2, 10)):
        batch = make_batch("extend", True, [[]])
        batch.reqs[0].rid = "r1"
        _chunked(batch, 0, end, shape)
        _prefill(sched, batch, logits[k][:1])
    cap = read_capture(capture_dir)
    assert not cap.errors, cap.errors
    assert (cap.cost["prefills"], cap.cost["plain_prefills"]) == (2, 1), cap.cost  # the middle chunk's batch: plain
    got = [(p.rid, p.token, p.prompt_len, p.context) for p in cap.prefills[0]]  # rank 0's, in write order
    assert got == [("r0", int(logits[0][0].argmax()), 3, [0, [1, 2, 3], 3]),
                   ("r1", int(logits[2][0].argmax()), 10, [0, list(range(1, 11)), 10])], got


def test_a_release_whose_requests_say_neither_where_a_chunk_ends_is_a_capture_error(capture_dir):
    """Requests with neither ``extend_range`` nor ``fill_ids``: the prefill records nothing and says why in an error
    record (a middle chunk's token must never pass for a first token)."""
    sched, *_ = make_scheduler()
    batch = make_batch("extend", True, [[], []])
    for r in batch.reqs:
        del r.extend_range
    _prefill(sched, batch, torch.randn(2, V))
    cap = read_capture(capture_dir)
    assert not cap.prefills.get(0)
    assert len(cap.errors) == 1 and "neither extend_range nor fill_ids" in str(cap.errors[0]), cap.errors


def test_prefill_end_reads_extend_range_first_then_fill_ids():
    assert versions.prefill_end(NS(extend_range=NS(start=4, end=8), fill_ids=[1])) == 8
    assert versions.prefill_end(NS(extend_range=None, fill_ids=[1, 2, 3])) == 3
    assert versions.prefill_end(NS(fill_ids=[1, 2])) == 2
    assert versions.prefill_end(NS(extend_range=None)) is None


def test_decode_steps_run_inside_prefill_batches_are_said_once_as_a_capture_error(capture_dir):
    """``--enable-mixed-chunk``: SGLang folds running requests' decode steps into prefill batches (``MIXED``), which
    the capture does not record; the first such batch says so in one error record, the next says nothing more."""
    sched, *_ = make_scheduler()
    for _ in range(2):
        batch = make_batch("extend", False, [[], [5]])
        batch.forward_mode = NS(is_extend=lambda: True, is_decode=lambda: False, is_mixed=lambda: True)
        _prefill(sched, batch, torch.randn(2, V))
    cap = read_capture(capture_dir)
    assert len(cap.errors) == 1 and "--enable-mixed-chunk" in str(cap.errors[0]), cap.errors
    assert [p.rid for p in cap.prefills[0]] == ["r0", "r0"]  # the prompts it finishes are still recorded



def test_a_server_with_dp_attention_says_its_capture_is_not_judged_as_is(capture_dir):
    """``--enable-dp-attention`` shards attention by data-parallel groups, which the state sketches do not model:
    the process's recorder says so in an error record (the diff then fails the capture, never judging it
    silently)."""
    sched, *_ = make_scheduler()
    sched.server_args.enable_dp_attention = True
    _prefill(sched, make_batch("extend", True, [[], []]), torch.randn(2, V))
    cap = read_capture(capture_dir)
    assert len(cap.errors) == 1 and "--enable-dp-attention" in str(cap.errors[0]), cap.errors
