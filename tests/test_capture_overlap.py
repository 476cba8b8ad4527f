"""SGLang's overlap scheduler hands ``run_batch``'s results back before they exist on the host: the tokens are copied
to pinned host memory on a copy stream (``result.copy_done`` marks the end), and a batch holding a grammar request
without speculation is sampled only later (``result.delay_sample_func``, called after the previous batch's results
are processed). The capture reads the tokens after the copy has landed, and records a delayed batch once it has
been sampled, with the sampler's hook seeing it as in ``run_batch``. (The copy's ordering on a real device:
``tests/test_gpu.py::test_a_host_copy_still_in_flight_is_read_after_it_lands``.)"""

from __future__ import annotations

from types import SimpleNamespace as NS

import torch
from capture_kit import V, make_batch, make_scheduler, read_capture  # tests/capture_kit.py

from refcheck.sglang.capture import hooks
from refcheck.sglang.capture.batch import on_device
from refcheck.sglang.capture.shipper import read_ledgers


def _delayed(logits: torch.Tensor, sampled: list) -> object:
    """A result whose tokens SGLang samples later: ``delay_sample_func`` runs the sampler (as SGLang's
    ``ModelRunner.sample``, through the capture's hook) and returns the result, as SGLang asserts."""
    result = NS(logits_output=NS(next_token_logits=logits), next_token_ids=None, delay_sample_func=None)

    def model_runner_sample(self, logits_output, forward_batch):
        sampled.append(hooks._batch is not None)  # the sampler's hook sees the batch being recorded
        return logits_output.next_token_logits.argmax(-1)

    def later():
        result.next_token_ids = hooks._sample(model_runner_sample, None, result.logits_output,
                                              NS(forward_mode=None, sampling_info=None))
        return result

    result.delay_sample_func = later
    return result


def test_a_prefill_sampled_after_run_batch_is_recorded_once_sampled(capture_dir):
    """Overlap, no speculation, a grammar request in the batch: ``run_batch`` returns no tokens; nothing is recorded
    (and no error) until SGLang calls the delayed sampler, after which the batch's first tokens are recorded, and
    the sampler's hook saw the batch as it does in ``run_batch``."""
    sched, *_ = make_scheduler()
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(4))
    sampled: list = []
    result = hooks._run_batch(lambda self, b: _delayed(logits, sampled), sched, make_batch("extend", False, [[], []]))
    assert result.next_token_ids is None and not read_capture(capture_dir).prefills.get(0)
    assert result.delay_sample_func() is result  # SGLang's launch_batch_sample_if_needed
    assert sampled == [True] and result.next_token_ids is not None
    cap = read_capture(capture_dir)
    assert not cap.errors, cap.errors
    assert [(p.rid, p.token) for p in cap.prefills[0]] == [("r0", int(logits[0].argmax())), ("r1", int(logits[1].argmax()))]
    ledger = read_ledgers(capture_dir)
    assert (ledger["prefills"], ledger["plain_prefills"]) == (1, 0)


def test_a_target_only_decode_sampled_after_run_batch_is_recorded_once_sampled(capture_dir):
    """The same for a decode batch without speculation (NONE): its step is recorded with the sampled tokens."""
    sched, *_ = make_scheduler()
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(5))
    sampled: list = []
    result = hooks._run_batch(lambda self, b: _delayed(logits, sampled), sched, make_batch("decode", False, [[7], [9]]))
    assert not read_capture(capture_dir).steps.get(0)
    result.delay_sample_func()
    cap = read_capture(capture_dir)
    assert not cap.errors, cap.errors
    assert [(s.rid, list(s.emitted)) for s in cap.steps[0]] == [("r0", [int(logits[0].argmax())]),
                                                               ("r1", [int(logits[1].argmax())])]
    assert read_ledgers(capture_dir)["recorded_batches"] == 1


def test_a_host_tensor_is_taken_as_it_is_off_cuda_whatever_the_event():
    t = torch.tensor([3, 4])
    assert torch.equal(on_device(t, "cpu", ready=object()), t)
    assert hooks._copied(NS(copy_done=object())) is None and hooks._copied(NS()) is None
