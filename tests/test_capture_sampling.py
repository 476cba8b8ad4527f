"""Sampled capture and what it costs: the hooks record the decode batches the rule takes
(refcheck/sglang/capture/step_clock.py: each request's step count, the sweep of finished requests) and pass the
others over reading nothing but their rids, booking each batch, recorded or plain, prefill or decode, in the
cost ledger."""

from __future__ import annotations

from types import SimpleNamespace as NS

import torch
from capture_kit import (  # tests/capture_kit.py
    N,
    V,
    make_batch,
    make_scheduler,
    make_tree,
    read_capture,
    run_prefill,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from refcheck.sglang.capture import hooks


def test_a_sampled_capture_records_the_steps_its_rule_takes_and_leaves_other_batches_alone(capture_dir, monkeypatch):
    """REFCHECK_CAPTURE_SAMPLE=2:3: one decode batch in two is recorded, all its requests (their step numbers
    kept); a batch not taken runs its hooks straight through (no records, no device work)."""
    from refcheck.sglang.capture.sample_rule import SampleRule

    monkeypatch.setenv("REFCHECK_CAPTURE_SAMPLE", "2:3")
    rule = SampleRule(2, 3)
    sched, *_ = make_scheduler()
    run_prefill(sched)
    tokens, nt, ns = make_tree()
    out = (torch.tensor([12, 0, 30, 0, 21, 23, 0, 31]), torch.tensor([2, 3]), torch.tensor([[0, 2, -1, -1], [4, 5, 7, -1]]))
    calls = []

    def worker(self, b):
        vi = NS(draft_token=tokens, retrieve_next_token=nt, retrieve_next_sibling=ns, positions=None)
        hooks._eagle_sample(lambda *a: calls.append(hooks._batch is not None) or out, vi, b,
                             NS(next_token_logits=torch.randn(2 * N, V)), None)
        return NS(logits_output=None, next_token_ids=None)

    for k in range(4):
        hooks._run_batch(worker, sched, make_batch("decode", True, [[7] * (k + 1), [9] * (k + 1)]))
    cap = read_capture(capture_dir)
    assert not cap.errors, cap.errors
    taken = [k for k in range(4) if rule.takes(k)]
    assert len(taken) == 2 and taken[1] == taken[0] + 2
    want = [(rid, k) for k in taken for rid in ("r0", "r1")]
    assert [(s.rid, s.meta["step_index"]) for s in cap.steps[0]] == want
    assert calls == [k in taken for k in range(4)]
    r1 = [s for s in cap.steps[0] if s.rid == "r1"]
    assert all(s.accepted == [0, 1, 3] for s in r1)  # accept_index's flat rows counted in SGLang's whole batch


def test_a_batch_the_sampling_rule_passes_over_reads_nothing_but_its_rids_and_is_booked_plain(capture_dir, monkeypatch):
    """Under 1 batch in 2, a target-only decode batch that is not taken runs as SGLang has it: its requests'
    token lists and pool rows are never read (the stand-in raises if they are), and its wall time goes to the
    ledger's plain side; a taken batch is recorded and booked with its hooks' share."""
    from refcheck.sglang.capture.sample_rule import SampleRule

    monkeypatch.setattr(hooks, "_rule", SampleRule(2, seed=0))
    sched, *_ = make_scheduler()
    run_prefill(sched)  # the recorder exists from here on

    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"a batch the rule passes over read {name}")

    def step(self, b):
        logits = torch.randn(2, V)
        return NS(logits_output=NS(next_token_logits=logits), next_token_ids=logits.argmax(-1))

    for g in range(4):
        batch = make_batch("decode", False, [[5], [6]])
        if not SampleRule(2, seed=0).takes(g):
            batch.req_pool_indices = Untouchable()
            batch.reqs = [NS(rid=r.rid) for r in batch.reqs]  # no token lists
        hooks._run_batch(step, sched, batch)
    cap = read_capture(capture_dir)
    assert not cap.errors, cap.errors
    assert sorted({s.meta["step_index"] for ss in cap.steps.values() for s in ss}) == [k for k in range(4)
                                                                                   if SampleRule(2, 0).takes(k)]
    cost = cap.cost
    assert cost["plain_batches"] == 2 and cost["recorded_batches"] == 2, cost
    assert 0 < cost["hooks_ms_per_batch"] <= cost["recorded_ms_per_batch"] and cost["plain_ms_per_batch"] > 0
    parts = cost["parts_ms_per_batch"]
    assert parts["state"] > 0 and parts["ship"] > 0 and parts["snapshot"] > 0 and not parts["taps"], parts
    assert sum(parts.values()) <= cost["hooks_ms_per_batch"] + 1e-3



def test_the_first_traced_plain_batch_after_a_recorded_one_is_booked_as_next(capture_dir, monkeypatch):
    """The ledger's ``next`` side holds each plain decode batch that comes right after a recorded one (where the
    recorded batch's device work and its record's writing land): under 1 batch in 3, a batch of untraced requests
    run between a recorded batch and the next traced one is neither counted there nor clears it; the traced plain
    batch after it is."""
    from refcheck.sglang.capture.sample_rule import SampleRule
    from refcheck.sglang.env import UNTRACED_RID_PREFIX

    rule = SampleRule(3, seed=0)
    monkeypatch.setattr(hooks, "_rule", rule)
    monkeypatch.setattr(hooks, "_after_recorded", False)
    sched, *_ = make_scheduler()
    run_prefill(sched)

    def step(self, b):
        logits = torch.randn(len(b.reqs), V)
        return NS(logits_output=NS(next_token_logits=logits), next_token_ids=logits.argmax(-1))

    nexts = 0
    for g in range(7):
        hooks._run_batch(step, sched, make_batch("decode", False, [[5] * (g + 1), [6] * (g + 1)]))
        if rule.takes(g):
            untraced = make_batch("decode", False, [[4]])
            untraced.reqs[0].rid = f"{UNTRACED_RID_PREFIX}u{g}"
            hooks._run_batch(step, sched, untraced)
        nexts += int(g > 0 and rule.takes(g - 1) and not rule.takes(g))
    cost = read_capture(capture_dir).cost
    assert nexts == 2 and cost["next_batches"] == nexts, cost
    assert cost["plain_batches"] == 7 - sum(map(rule.takes, range(7))) + 2, cost  # the untraced ones are plain too
    assert 0 < cost["next_ms_per_batch"]
    assert not hooks._after_recorded  # the last batch (g = 6) was not recorded


@settings(max_examples=60, deadline=None)
@given(every=st.integers(1, 9), seed=st.integers(0, 50), marked=st.lists(st.tuples(st.integers(1, 5), st.integers(0, 9)),
                                                                         max_size=3),
       batches=st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 5), min_size=1, max_size=6, unique=True)),
                        min_size=1, max_size=25))
def test_the_step_clock_takes_the_batches_and_step_numbers_each_request_rule_takes(every, seed, marked, batches):
    """refcheck/sglang/capture/step_clock.py (a batch's requests to record) against SampleRule.takes: request i of a
    decode batch is taken when its rule (its rid's mark, else the process's) takes the process's g-th decode batch,
    and carries its own step number (its decode batches so far), whichever requests share the batch; request i of a
    prefill batch when its rule takes the process's p-th prefill batch, prefills and decodes counted apart."""
    from refcheck.sglang.capture.sample_rule import SampleRule, rule_for, sampled_rid
    from refcheck.sglang.capture.step_clock import StepClock

    process = SampleRule(every, seed)
    rids = [sampled_rid(SampleRule(e, s), f"r{i}") for i, (e, s) in enumerate(marked)]
    rids += [f"plain{i}" for i in range(6 - len(rids))]
    reqs = [NS(rid=r) for r in rids]
    clock, steps, counted = StepClock(process), {}, {True: 0, False: 0}
    for prefill, members in batches:
        batch, g = [rids[m] for m in members], counted[prefill]
        counted[prefill] += 1
        if prefill:
            assert clock.take_prefill(batch, [reqs[m] for m in members]) == [
                b for b, r in enumerate(batch) if rule_for(r, process).takes(g)]
            continue
        take, numbers = clock.take(batch, [reqs[m] for m in members])
        want = [(b, steps.get(r, 0)) for b, r in enumerate(batch) if rule_for(r, process).takes(g)]
        assert list(zip(take, numbers)) == want
        for r in batch:
            steps[r] = steps.get(r, 0) + 1


def test_the_step_counts_of_requests_sglang_let_go_of_are_swept():
    """StepClock's sweep, every sweep_every decode batches and every sweep_every prefill batches: a request object no
    batch can hold again (gone) loses its step count; one still alive (waiting, retracted) keeps counting; one that
    takes no weak reference is kept."""
    import gc

    from refcheck.sglang.capture.sample_rule import SampleRule
    from refcheck.sglang.capture.step_clock import StepClock

    class Req:  # as SGLang's: takes weak references
        def __init__(self, rid):
            self.rid = rid

    class Slotted:
        __slots__ = ("rid",)

        def __init__(self, rid):
            self.rid = rid

    clock = StepClock(SampleRule(), sweep_every=4)
    live, gone, slotted = Req("live"), Req("gone"), Slotted("slotted")

    def decode(*reqs):
        take, steps = clock.take([r.rid for r in reqs], list(reqs))
        return {reqs[b].rid: k for b, k in zip(take, steps)}

    prefill_only = [Req(f"embed{i}") for i in range(4)]  # requests that end at their prefill (one token)
    for r in prefill_only:
        clock.take_prefill([r.rid], [r])
    assert len(clock) == 4
    del prefill_only, r
    gc.collect()
    for _ in range(4):
        clock.take_prefill([], [])
    assert len(clock) == 0  # a run of prefills sweeps too
    first = decode(live, gone, slotted)
    assert first == {"live": 0, "gone": 0, "slotted": 0}  # every step taken (full capture)
    del gone
    gc.collect()
    assert len(clock) == 3 and "gone" in clock  # not swept before its batch
    for _ in range(3):
        decode(slotted)
    assert len(clock) == 2 and "gone" not in clock
    assert decode(live, slotted) == {"live": 1, "slotted": 4}


def test_prefills_are_booked_recorded_and_plain(capture_dir):
    """The ledger's prefill side: a traced prefill (full capture: recorded) books its wall time and the hooks' share; an
    untraced prefill after it books its wall time as plain; decode batches stay on their own side."""
    from refcheck.sglang.capture.shipper import ledger_summary, read_ledgers
    from refcheck.sglang.env import UNTRACED_RID_PREFIX

    sched, *_ = make_scheduler()
    run_prefill(sched)
    untraced = make_batch("extend", True, [[], []])
    for r in untraced.reqs:
        r.rid = UNTRACED_RID_PREFIX + r.rid
    logits = torch.randn(2, V)
    hooks._run_batch(lambda self, b: NS(logits_output=NS(next_token_logits=logits), next_token_ids=logits.argmax(-1)),
                     sched, untraced)
    ledger = read_ledgers(capture_dir)
    cost = ledger_summary(ledger, ledger["written"])
    assert (ledger["prefills"], ledger["plain_prefills"], ledger["recorded_batches"], ledger["plain_batches"]) == (1, 1, 0, 0)
    assert 0 < cost["prefill_hooks_ms_per_batch"] <= cost["prefill_ms_per_batch"] and cost["plain_prefill_ms_per_batch"] > 0
    assert read_capture(capture_dir).prefills[0] and len(read_capture(capture_dir).prefills[0]) == 2  # one record only


def test_a_sampled_capture_records_one_prefill_batch_in_every_on_its_own_clock(capture_dir, monkeypatch):
    """Under 1 batch in 2, prefill batches are taken by the rule on their own clock: a taken prefill records its
    requests' first tokens, one not taken records nothing and is booked plain; the decode batches' clock does not
    move with them. Each request the clock met is counted in the ledger, the four whose only batch was passed over
    (they end at their prefill) too."""
    from refcheck.sglang.capture.sample_rule import SampleRule

    rule = SampleRule(2, seed=5)
    monkeypatch.setattr(hooks, "_rule", rule)
    sched, *_ = make_scheduler()
    logits = torch.randn(2, V)
    for p in range(4):
        batch = make_batch("extend", True, [[], []])
        for r in batch.reqs:
            r.rid = f"p{p}-{r.rid}"
        hooks._run_batch(lambda self, b: NS(logits_output=NS(next_token_logits=logits), next_token_ids=logits.argmax(-1)),
                         sched, batch)
    cap = read_capture(capture_dir)
    assert not cap.errors, cap.errors
    taken = [p for p in range(4) if rule.takes(p)]
    assert len(taken) == 2
    assert sorted(r.rid for r in cap.prefills[0]) == sorted(f"p{p}-r{i}" for p in taken for i in range(2))
    assert (cap.cost["prefills"], cap.cost["plain_prefills"]) == (2, 2), cap.cost
    assert hooks._step_clock().batches == 0 and hooks._step_clock().prefills == 4
    assert cap.requests_met == 8 and len({r.rid for r in cap.prefills[0]}) == 4


def test_a_request_prefilled_again_after_a_retraction_records_no_second_first_token(capture_dir):
    """SGLang retracts a request under memory pressure and prefills it again, prompt and output so far: that prefill
    finishes its prompt but is not its first token. The batch records request 0's first token only, and carries
    request 0's context only."""
    sched, *_ = make_scheduler()
    batch = make_batch("extend", True, [[], [5, 6]])
    assert batch.reqs[1].extend_range.end == 5  # the retracted request: its prompt and output filled again
    logits = torch.randn(2, V)
    hooks._run_batch(lambda self, b: NS(logits_output=NS(next_token_logits=logits), next_token_ids=logits.argmax(-1)),
                     sched, batch)
    cap = read_capture(capture_dir)
    assert not cap.errors, cap.errors
    assert [(p.rid, p.token, p.context) for p in cap.prefills[0]] == [("r0", int(logits[0].argmax()), [0, [1, 2, 3], 3])]
