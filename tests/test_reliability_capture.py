"""Capture never raises into SGLang's step, whatever fails on refcheck's side: a capture directory that takes no
recorder, a disk that refuses an error record or a batch record, a drafter tap that fails inside SGLang's forward.
Each failure is said (stderr, the engine's log; an error record; a lost count; the draft side's missing reason)."""

from __future__ import annotations

import errno
from types import SimpleNamespace as NS

import torch
from capture_kit import fresh_hooks  # tests/capture_kit.py

from refcheck.sglang.capture import dflash_taps, hooks
from refcheck.sglang.capture.records import Recorder
from refcheck.sglang.capture.segments import scan, segment_files
from refcheck.sglang.capture.shipper import queue_files, read_counts


def _decode_batch():
    return NS(forward_mode=NS(is_extend=lambda: False, is_decode=lambda: True), spec_algorithm=NS(is_none=lambda: True),
              reqs=[NS(rid="r0", origin_input_ids=[1, 2], output_ids=[3])], req_pool_indices=torch.arange(1))


def test_a_capture_directory_that_takes_no_recorder_leaves_every_batch_to_sglang(tmp_path, monkeypatch, capsys):
    """REFCHECK_CAPTURE_DIR under a file: the step runs and returns SGLang's result, batch after batch, and the
    engine's log says once why this process records nothing."""
    (tmp_path / "file").write_text("")
    fresh_hooks(monkeypatch, tmp_path / "file" / "capture")
    for _ in range(3):
        assert hooks._run_batch(lambda self, b: "sglang's result", NS(tp_rank=0), _decode_batch()) == "sglang's result"
    err = capsys.readouterr().err
    assert err.count("refcheck capture: cannot record in") == 1 and "NotADirectoryError" in err
    hooks._error("somewhere", "nothing to write it to")  # an error with no recorder is dropped, not raised


def _refusing(monkeypatch):
    def full(fd, parts):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("refcheck.sglang.capture.segments.write_all", full)


def test_an_error_record_the_disk_refuses_is_said_once_and_counted(tmp_path, monkeypatch, capsys):
    rec = Recorder(tmp_path)
    _refusing(monkeypatch)
    for k in range(3):
        rec.error("run_batch", f"error {k}\nwith a traceback")
    err = capsys.readouterr().err
    assert rec.unwritten_errors == 3 and err.count("refcheck capture: cannot write to") == 1
    assert "No space left on device" in err and "run_batch: error 0" in err and "traceback" not in err


def test_a_batch_record_the_disk_refuses_is_counted_lost_and_the_queue_drains(tmp_path, monkeypatch):
    """The writer thread is done with a record it could not write (the engine's parent stops waiting) and counts it
    lost, which the reader reports: a missing step is never silent, even when no error record can be written."""
    rec = Recorder(tmp_path)
    rec.ship("batch", {"n": 0}, {"t": torch.arange(4)})
    assert rec.shipper.drain(10.0)
    _refusing(monkeypatch)
    rec.ship("batch", {"n": 1}, {"t": torch.arange(4)})
    assert rec.shipper.drain(10.0)
    (queued, written, lost), = [read_counts(f) for f in queue_files(tmp_path)]
    assert (queued, written, lost) == (2, 2, 1) and rec.unwritten_errors == 1
    monkeypatch.undo()
    assert [len(scan(f).frames) for f in segment_files(rec.dir, "records")] == [1]  # written before the disk filled


class _Worker:
    """A DFLASH worker stand-in: its draft runner's forward and drafter-KV writer, as SGLang's step calls them."""

    def __init__(self):
        self.block_size = 4
        self.fed = []
        self.draft_model_runner = NS(model=NS(num_context_features=1),
                                     forward=lambda fb: NS(logits_output=NS(hidden_states=torch.ones(8, 3))))
        self.target_worker = NS(model_runner=NS(model=NS(lm_head=NS(weight=torch.ones(5, 3))),
                                                model_config=NS(vocab_size=5)))

    def _append_target_hidden_to_draft_kv_by_loc(self, **kw):
        self.fed.append(kw)
        return "appended"


class _Failing:
    def run(self, key, fn, *inputs):
        raise RuntimeError(f"graph {key[0]} failed")


def test_a_drafter_tap_that_fails_inside_sglangs_forward_leaves_the_forward_to_sglang():
    """Both taps run inside SGLang's DFLASH forward; when refcheck's part fails, SGLang's draft result and its
    drafter-KV write go on as they are and the taps say why the draft side is missing."""
    worker = _Worker()
    with dflash_taps.dflash_taps(worker, 2, True, None, (_Failing(), _Failing())) as taps:
        out = worker.draft_model_runner.forward(None)
        fed = worker._append_target_hidden_to_draft_kv_by_loc(
            target_hidden=torch.ones(8, 3), cache_loc=torch.arange(8), positions=torch.arange(8),
            commit_lens=torch.full((2,), 2))
    assert torch.equal(out.logits_output.hidden_states, torch.ones(8, 3)) and fed == "appended"
    assert len(worker.fed) == 1 and taps.draft is None and taps.context is None
    assert taps.missing == "the drafter's context could not be kept (RuntimeError: graph context failed)"


def test_a_layer_sketch_that_fails_inside_sglangs_forward_keeps_no_sketch_of_that_forward(monkeypatch):
    """The layer-sketch forward hook (refcheck/sglang/capture/layers.py) on an output it cannot sketch: SGLang's
    forward goes on, and that forward is never taken as a complete one (the record then holds no layer sketches)."""
    from collections import deque

    from refcheck.sglang.capture import layers

    monkeypatch.setattr(layers, "FORWARDS", deque(maxlen=4))
    hook = layers.hook_factory({})
    for layer in range(3):
        hook(NS(layer_id=layer), (), torch.ones(2, 8) if layer != 1 else "not a tensor")
    assert layers.take(2, 3) is None
    for layer in range(3):
        hook(NS(layer_id=layer), (), torch.ones(2, 8))
    assert layers.take(2, 3).shape == (3, 2, 16)


def test_a_sampling_rule_the_engine_cannot_read_is_one_error_and_no_records(tmp_path, monkeypatch):
    """REFCHECK_CAPTURE_SAMPLE=0 in a server's environment (refcheck's own runner refuses it before any start): the
    process says why once and records nothing, every batch SGLang's own and booked plain, not full capture."""
    from capture_kit import read_capture

    fresh_hooks(monkeypatch, tmp_path)
    monkeypatch.setenv("REFCHECK_CAPTURE_SAMPLE", "0")
    for _ in range(3):
        assert hooks._run_batch(lambda self, b: "sglang's result", NS(tp_rank=0), _decode_batch()) == "sglang's result"
    cap = read_capture(tmp_path)
    assert len(cap.errors) == 1 and "REFCHECK_CAPTURE_SAMPLE='0'" in cap.errors[0] and "records nothing" in cap.errors[0]
    assert not cap.steps and cap.cost["plain_batches"] == 3 and cap.status[0]["sample"] is None
