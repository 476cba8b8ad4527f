"""What a capture's records say of their requests (refcheck/sglang/capture/contexts.py): each record carries the
context tokens no earlier record of its request carried, and its first record the request's sampling parameters, so
the records alone give every recorded request's prompt and output up to its last recorded step."""

from __future__ import annotations

from types import SimpleNamespace as NS

import torch
from capture_kit import V, make_batch, make_scheduler, read_capture, run_prefill  # tests/capture_kit.py
from hypothesis import given, settings
from hypothesis import strategies as st

from refcheck.sglang.capture import hooks
from refcheck.sglang.capture.contexts import Contexts, delta, params_of


@settings(max_examples=80, deadline=None)
@given(prompt=st.lists(st.integers(0, 99), min_size=1, max_size=8), growth=st.lists(st.integers(0, 5), max_size=8),
       carried=st.lists(st.booleans(), max_size=8))
def test_pieces_carried_at_any_batches_join_to_the_whole_context(prompt, growth, carried):
    """A request whose output grows batch by batch, recorded at any subset of its batches: the pieces each record
    carries (delta from what was carried before) join to its context at its last recorded batch, with no hole."""
    output: list[int] = []
    known, contexts, last = 0, Contexts(), None
    for k, n in enumerate(growth):
        if k < len(carried) and carried[k]:
            tokens = delta(known, prompt, output)
            contexts.add("r", known, tokens)
            known += len(tokens)
            last = prompt + output
        output = output + [100 + k] * n
    assert contexts.known("r") == (last or []) and not contexts.holes and not contexts.conflicts


def test_a_lost_piece_is_a_hole_and_a_changed_token_a_conflict():
    c = Contexts()
    c.add("r", 0, [1, 2, 3])
    c.add("r", 2, [3, 4])  # overlaps what is known, and agrees
    c.add("r", 7, [9])  # the piece for 5..6 never came
    c.add("r", 8, [10])
    assert c.known("r") == [1, 2, 3, 4] and len(c.holes) == 1 and "4..6" in c.holes[0]
    c.add("q", 0, [1, 2])
    c.add("q", 1, [5, 6])
    assert c.known("q") == [1, 2, 6] and c.conflicts == ["q: a record carries context tokens from 1 that differ from an "
                                                          "earlier record's"]


def test_params_are_plain_values_of_what_the_request_has():
    sp = NS(temperature=1.0, top_k=1, top_p=0.9, logit_bias={"5": 2}, json_schema=None, min_new_tokens=0)
    got = params_of(NS(sampling_params=sp))
    assert got is not None and got["top_k"] == 1 and got["logit_bias"] == {"5": 2.0} and got["json_schema"] is None
    assert "max_new_tokens" in got and got["max_new_tokens"] is None  # a field this request's params lack
    assert params_of(NS()) is None


def _decode(sched, outputs, gen):
    logits = torch.randn(len(outputs), V, generator=gen)
    batch = make_batch("decode", False, outputs)
    for r in batch.reqs:
        r.sampling_params = NS(temperature=1.0, top_k=1, max_new_tokens=64)
    hooks._run_batch(lambda self, b, lg=logits: NS(logits_output=NS(next_token_logits=lg), next_token_ids=lg.argmax(-1)),
                     sched, batch)


def test_the_hooks_records_carry_each_requests_context_once_and_its_params_first(capture_dir, monkeypatch):
    """A prefill and five target-only decode batches of two requests, one batch in two recorded: the prefill record
    carries each prompt, each decode record the tokens gained since the request's last record; joined in write
    order they give the context at the last recorded batch. Only a request's first record carries its parameters."""
    from refcheck.sglang.capture.sample_rule import SampleRule

    monkeypatch.setattr(hooks, "_rule", SampleRule(2, seed=0))
    gen = torch.Generator().manual_seed(0)
    sched, *_ = make_scheduler()
    run_prefill(sched)
    outputs = [[], []]
    last = {}
    for k in range(5):
        outputs = [o + [10 * k + i, 10 * k + i + 1] for i, o in enumerate(outputs)]
        taken = SampleRule(2, seed=0).takes(k)
        _decode(sched, outputs, gen)
        if taken:
            last = {f"r{i}": [1, 2, 3, *o] for i, o in enumerate(outputs)}
    cap = read_capture(capture_dir)
    assert not cap.errors, cap.errors
    joined = Contexts()
    records = [*cap.prefills.get(0, []), *cap.steps[0]]  # the prefill was written first
    for r in records:
        joined.add(r.rid, r.context[0], r.context[1], r.params, r.context[2])
    assert {rid: joined.known(rid) for rid in ("r0", "r1")} == last and not joined.holes and not joined.conflicts
    assert [p.context for p in cap.prefills[0]] == [[0, [1, 2, 3], 3], [0, [1, 2, 3], 3]]
    assert joined.prompt_lens == {"r0": 3, "r1": 3}
    assert all(s.params is None for s in cap.steps[0])  # the prefill carried the first part of every context
    assert all(p.params is None for p in cap.prefills[0])  # the stand-in prefill's requests carry no parameters


def test_a_requests_first_record_carries_its_sampling_parameters(capture_dir):
    """Recorded first at a decode batch (full capture), a request's record carries its whole context so far and its
    parameters; its next record only the tokens it gained, and no parameters."""
    gen = torch.Generator().manual_seed(1)
    sched, *_ = make_scheduler()
    _decode(sched, [[5], [6]], gen)
    _decode(sched, [[5, 7, 8], [6, 9]], gen)
    cap = read_capture(capture_dir)
    assert not cap.errors, cap.errors
    first, second = cap.steps[0][:2], cap.steps[0][2:]
    assert [s.context for s in first] == [[0, [1, 2, 3, 5], 3], [0, [1, 2, 3, 6], 3]]
    assert [s.params["top_k"] for s in first] == [1, 1] and [s.params["max_new_tokens"] for s in first] == [64, 64]
    assert [s.context for s in second] == [[4, [7, 8], 3], [4, [9], 3]] and all(s.params is None for s in second)


def test_a_carried_context_is_a_prefix_of_the_whole_or_says_where_it_differs():
    c = Contexts.of([NS(rid="r", context=[3, [4, 5], 3], params=None), NS(rid="r", context=[0, [1, 2, 3], 3], params=None),
                     NS(rid="q", context=None, params=None)])
    assert c.known("r") == [1, 2, 3, 4, 5] and "q" not in c and c.prompt_lens == {"r": 3}
    assert c.differs("r", [1, 2, 3, 4, 5, 6]) is None and c.differs("r", [1, 2, 9, 4, 5]) == 2
    assert c.differs("r", [1, 2, 3]) is None  # more than the output holds: SGLang cut it at its limit
