"""A capture of a serving run refcheck did not start (refcheck/sglang/served.py): its records' contexts and its
status's server arguments become a trace the diff judges, as a run refcheck drove would be. The captures here are
tests/fake_engine_kit.py's fake SGLang (the reference's own forwards, batched as SGLang batches them), with
each record carrying the piece of its request's context the hooks would give it."""

from __future__ import annotations

import json
from types import SimpleNamespace as NS

import pytest
import torch
from fake_engine_kit import _sampled, fake_engine_setup, fake_sglang  # tests/fake_engine_kit.py

from ddtree_reference.sampling import Sampling
from refcheck.diff.judge import judge
from refcheck.models import builtin_pair
from refcheck.pool import ReferencePool
from refcheck.sglang.capture.contexts import delta
from refcheck.sglang.capture.inventory import CaptureDirError
from refcheck.sglang.capture.sample_rule import SampleRule
from refcheck.sglang.served import UNRECORDED, ServedCaptureError, served_trace, trace_of


@pytest.fixture(scope="module")
def setup():
    return fake_engine_setup()


GREEDY = {"temperature": 1.0, "top_k": 1, "top_p": 1.0, "max_new_tokens": 64, "repetition_penalty": 1.0}


def _served(cap, prompts, results, rids, params=None, algorithm="NGRAM"):
    """The fake capture as the hooks write it in a serving run: each record carries the piece of its request's context
    no earlier record carried (the first, its parameters), and the status the server's arguments."""
    by_rid = {rids[p.id]: (list(p.prompt_ids), list(results[p.id]["output_ids"])) for p in prompts}
    known: dict[str, int] = {}
    for r in [*cap.prefills.get(0, []), *cap.steps.get(0, [])]:  # the fake engine prefills first, then batches
        prompt, output = by_rid[r.rid]
        upto = 0 if not hasattr(r, "committed_len") else r.committed_len - len(prompt) + 1  # the root's output prefix
        start = known.get(r.rid, 0)
        tokens = delta(start, prompt, output[:upto])
        r.context, r.params = [start, tokens, len(prompt)], (params or {}).get(r.rid, GREEDY) if r.rid not in known else None
        known[r.rid] = start + len(tokens)
    server = {"model_path": str(builtin_pair("hybrid")[0]), "dtype": "float32", "speculative_algorithm": algorithm,
              "speculative_num_draft_tokens": 16, "speculative_draft_model_path": None}
    cap.status = [{"sglang": "0.5.17", "tp_rank": 0, "server": server, "serving": {"overlap": False},
                   "sample": {"every": 1, "seed": 0}, "max_bytes": None,
                   "hooks": dict.fromkeys(("run_batch", "eagle_sample", "dflash", "sample", "verify_coins"), True)}]
    return cap


def _judge(trace):
    return judge(trace, ReferencePool(), "served", mode="replay")


def test_a_served_capture_of_a_correct_engine_is_a_trace_that_passes(setup):
    """Every request's prompt and output come from its records alone (the output through its last recorded step),
    the budget from the server's draft tokens; the diff passes it and checks its state."""
    runner, prompts, trees = setup
    cap, results, rids = fake_sglang(runner, prompts, trees, "tree")
    served = trace_of(_served(cap, prompts, results, rids), "fake")
    trace = served.assembly.trace
    assert not served.left_out and not served.assembly.problems, served.assembly.problems
    assert [(r.request_id, r.prompt_ids, r.output_ids) for r in trace.requests] == \
           [(rids[p.id], list(p.prompt_ids), list(results[p.id]["output_ids"])) for p in prompts]
    assert trace.provenance["budget"] == 15 and trace.provenance["engine"]["settings"]["served"] is True
    rep = _judge(trace)
    assert not rep.failures and rep.exit_code == 0, [f.message for f in rep.failures]
    assert rep.checks["recurrent"] > 0 and len(trace.steps) == 4 * len(prompts)


def test_a_sampled_served_capture_is_judged_on_the_steps_it_holds(setup):
    """One batch in two: each record carries the tokens gained since its request's last record; the steps held pass."""
    runner, prompts, trees = setup
    cap, results, rids = fake_sglang(runner, prompts, trees, "tree")
    sampled = _sampled(cap, SampleRule(2, seed=3))
    served = _served(sampled, prompts, results, rids)
    served.status[0]["sample"] = {"every": 2, "seed": 3}
    trace = trace_of(served, "fake").assembly.trace
    assert {s.step for s in trace.steps} == {k for k in range(4) if SampleRule(2, 3).takes(k)}
    rep = _judge(trace)
    assert not rep.failures, [f.message for f in rep.failures]


def test_a_hook_that_was_not_live_fails_the_served_run(setup):
    """The status says eagle_sample's hook did not replace its target: a capture error, the run fails as "engine"."""
    runner, prompts, trees = setup
    cap, results, rids = fake_sglang(runner, prompts[:1], trees, "tree", steps=1)
    cap = _served(cap, prompts[:1], results, rids)
    cap.status[0]["hooks"]["eagle_sample"] = "missing: AttributeError"
    rep = _judge(trace_of(cap, "fake").assembly.trace)
    assert any(f.category == "engine" and "hook eagle_sample not live" in f.message for f in rep.failures)


def test_a_servers_state_in_the_mamba_extra_buffer_is_not_judged_and_said_so(setup):
    """A server whose radix cache kept the recurrent state in the mamba extra buffer (track slots the capture does not
    read): the trace carries no state, its state checks say unsupported and why, everything else is judged, and a
    leaky engine is still caught by its log-probs."""
    from refcheck.diff.findings import Verdict

    runner, prompts, trees = setup
    for leaky in (False, True):
        cap, results, rids = fake_sglang(runner, prompts[:2], trees, "tree", leaky=leaky, steps=2)
        cap = _served(cap, prompts[:2], results, rids)
        cap.status[0]["server"]["mamba_radix_cache_strategy"] = "extra_buffer"
        cap.status[0]["serving"]["radix_cache"] = True
        served = trace_of(cap, "fake")
        trace = served.assembly.trace
        assert served.state_not_judged and "track slots" in served.state_not_judged
        assert trace.provenance["engine"]["settings"]["state_not_judged"] == served.state_not_judged
        assert all(not s.state for s in trace.steps)
        rep = _judge(trace)
        unsupported = [f for f in rep.findings if f.verdict == Verdict.UNSUPPORTED and f.category == "recurrent"]
        assert unsupported and "recorded no state" in unsupported[0].message
        assert bool(rep.failures) == leaky and (not leaky or {f.category for f in rep.failures} & {"logits"})


def test_a_leaky_engine_served_is_caught(setup):
    """The recurrent layers run through the flattened tree (siblings leak): the served trace fails as a driven one."""
    runner, prompts, trees = setup
    cap, results, rids = fake_sglang(runner, prompts, trees, "tree", leaky=True)
    rep = _judge(trace_of(_served(cap, prompts, results, rids), "fake").assembly.trace)
    assert {f.category for f in rep.failures} & {"logits", "recurrent"}


def test_requests_the_reference_cannot_judge_are_left_out_and_counted(setup):
    """A request with a repetition penalty and one sampled at temperature 0.7 are left out of a trace of greedy
    requests, each counted by why; the trace says so."""
    runner, prompts, trees = setup
    cap, results, rids = fake_sglang(runner, prompts, trees, "tree")
    params = {rids[prompts[1].id]: {**GREEDY, "repetition_penalty": 1.1},
              rids[prompts[2].id]: {**GREEDY, "temperature": 0.7, "top_k": 1 << 30}}
    served = trace_of(_served(cap, prompts, results, rids, params), "fake")
    assert [r.request_id for r in served.assembly.trace.requests] == [rids[prompts[0].id]]
    assert served.left_out == {"repetition_penalty set": 1,
                               "another sampling setting (temperature 0.7, top-k 0, top-p 1)": 1}
    assert served.assembly.trace.provenance["engine"]["settings"]["left_out"] == served.left_out
    assert not _judge(served.assembly.trace).failures


def test_a_hole_in_a_requests_context_keeps_the_steps_before_it(setup):
    """One record's piece of a request's context is missing (that record was never written): the request keeps the
    steps whose context is known, the rest are dropped and the hole is said."""
    runner, prompts, trees = setup
    cap, results, rids = fake_sglang(runner, prompts[:1], trees, "tree")
    cap = _served(cap, prompts[:1], results, rids)
    cap.steps[0] = cap.steps[0][:2] + cap.steps[0][3:]  # the third step's record lost, with its piece
    served = trace_of(cap, "fake")
    assert [s.step for s in served.assembly.trace.steps] == [0, 1]
    assert any("in no record" in p for p in served.assembly.problems), served.assembly.problems


def test_what_is_not_a_served_capture_is_refused_with_what_to_do(tmp_path, setup):
    with pytest.raises(CaptureDirError, match="not a capture directory: no status-rank"):
        served_trace(tmp_path)
    (tmp_path / "status-rank0-pid1.json").write_text(json.dumps({"tp_rank": 0}))
    with pytest.raises(ServedCaptureError, match="no status file carries the server's arguments"):
        served_trace(tmp_path)
    runner, prompts, trees = setup
    cap, results, rids = fake_sglang(runner, prompts[:1], trees, "tree", steps=1)
    cap = _served(cap, prompts[:1], results, rids)
    cap.status[0]["server"]["model_path"] = "/models/not-here"
    with pytest.raises(ServedCaptureError, match=r"model '/models/not-here' is not a local checkpoint.*--model-dir"):
        trace_of(cap, "fake")
    assert trace_of(cap, "fake", model_dir=builtin_pair("hybrid")[0]).assembly.trace.requests


def test_a_driven_run_holds_its_records_contexts_to_its_prompts_and_outputs(setup):
    """With refcheck's runner the prompts and outputs come from the generate calls: a record whose context says the
    engine held another token than the output has there is a problem of the assembly; agreeing ones are none."""
    from refcheck.sglang.capture.assemble import assemble_trace

    runner, prompts, trees = setup
    cap, results, rids = fake_sglang(runner, prompts[:1], trees, "tree")
    cap = _served(cap, prompts[:1], results, rids)
    prov = runner.provenance(prompts[:1], engine="sglang", settings={"tree_rules": "structural"})
    assert not assemble_trace(prompts[:1], rids, results, cap, prov).problems
    piece = cap.steps[0][2].context
    piece[1][-1] += 1  # the engine's request held another token there
    problems = assemble_trace(prompts[:1], rids, results, cap, prov).problems
    at = piece[0] + len(piece[1]) - 1
    assert problems == [f"{prompts[0].id}: the context its records carry differs from its prompt and output at token {at}"]


def _hooks_serve(capture_dir) -> None:
    """The capture hooks (stand-in scheduler whose server arguments name the built-in target) record two target-only
    decode batches of two greedy requests into ``capture_dir``, every record written."""
    from types import SimpleNamespace as NS

    from capture_kit import V, make_batch, make_scheduler  # tests/capture_kit.py

    from refcheck.sglang.capture import hooks

    sched, *_ = make_scheduler()
    sched.server_args = NS(model_path=str(builtin_pair("hybrid")[0]), dtype="float32", speculative_algorithm=None)
    gen = torch.Generator().manual_seed(2)
    for outputs in ([[5], [6]], [[5, 7], [6, 9]]):
        logits = torch.randn(2, V, generator=gen)
        batch = make_batch("decode", False, outputs)
        for r in batch.reqs:
            r.sampling_params = NS(**GREEDY)
        hooks._run_batch(lambda self, b, lg=logits: NS(logits_output=NS(next_token_logits=lg),
                                                       next_token_ids=lg.argmax(-1)), sched, batch)
    assert hooks.drain(10.0)


def test_trace_import_writes_the_trace_of_a_capture_directory_the_hooks_wrote(capture_dir, tmp_path, cli):
    """`refcheck trace import` on what the hooks wrote: the trace of both requests, each request's prompt and output
    from its records, and what to run next; a second run with a bad --model-dir is exit 2 and leaves the trace as it
    was."""
    from refcheck.errors import EXIT_PASS, EXIT_USAGE
    from refcheck.trace.io import read_trace

    _hooks_serve(capture_dir)
    out = tmp_path / "served.arrow"
    code, _, err = cli("trace", "import", str(capture_dir), "--out", str(out))
    assert code == EXIT_PASS, err
    assert "2 request(s), 4 verify step(s)" in err and f"next: refcheck diff --against {out}" in err
    code, _, err = cli("trace", "show", str(out))
    assert code == EXIT_PASS and "served: the capture of a server refcheck did not start; left out: none" in err
    trace = read_trace(out)
    nxt = {s.request_id: s.emitted for s in trace.steps if s.step == 1}
    assert [(r.request_id, r.prompt_ids, r.output_ids) for r in trace.requests] == \
           [("r0", [1, 2, 3], [5, 7, *nxt["r0"]]), ("r1", [1, 2, 3], [6, 9, *nxt["r1"]])]
    before = out.read_bytes()
    code, _, err = cli("trace", "import", str(capture_dir), "--out", str(out), "--model-dir", str(tmp_path / "nowhere"))
    assert code == EXIT_USAGE and "--model-dir" in err and "is not a checkpoint directory (no config.json)" in err
    assert out.read_bytes() == before


def test_a_served_runs_draws_are_judged_as_the_engine_made_them():
    """NGRAM's tree sampler takes SGLang's coins children first; refcheck's keyed DDTree sampler needs the seed and
    request word refcheck's runner sends, which a server's clients do not: its served draws are the engine's own."""
    from refcheck.sglang.served import served_rng

    assert (served_rng("NGRAM"), served_rng("DFLASH"), served_rng("REFCHECK_DDTREE")) == \
           ("engine-children-first", "engine", "engine")


def test_a_served_capture_of_sampled_requests_is_judged_on_their_distribution(setup):
    """Every request at temperature 0.7 (top-k and top-p off): the trace carries that setting with the engine's own
    draws, and a correct sampler's steps pass."""
    from ddtree_reference.sampling import Sampling

    runner, prompts, trees = setup
    cap, results, rids = fake_sglang(runner, prompts, trees, "tree", sampling=Sampling(0.7, 0, 1.0, seed=5))
    warm = {**GREEDY, "temperature": 0.7, "top_k": 1 << 30}
    served = trace_of(_served(cap, prompts, results, rids, {rids[p.id]: warm for p in prompts}), "fake")
    trace = served.assembly.trace
    assert not served.left_out and all(r.temperature == 0.7 and r.rng == "engine-children-first" for r in trace.requests)
    rep = _judge(trace)
    assert not rep.failures, [f.message for f in rep.failures]


def test_a_running_servers_records_in_flight_are_counted_not_errors(capture_dir):
    """Two records queued but not yet written (the counters file says so, as a server still writing has it): read as
    a stopped engine's directory they are a capture error; read with ``running``, records in flight, counted."""
    from refcheck.sglang.capture.shipper import _FIELD, _OFFSET, queue_files, read_fields

    _hooks_serve(capture_dir)
    queue = queue_files(capture_dir)[0]
    data = bytearray(queue.read_bytes())
    _FIELD.pack_into(data, _OFFSET["queued"], read_fields(queue)["queued"] + 2)
    queue.write_bytes(bytes(data))
    stopped = served_trace(capture_dir).assembly.trace.provenance["capture"]
    assert any("still queued when the engine stopped" in e for e in stopped["errors"]), stopped["errors"]
    running = served_trace(capture_dir, running=True).assembly.trace.provenance["capture"]
    assert not [e for e in running["errors"] if "queued" in e] and running["stats"]["in_flight_batches"] == 2


def test_a_requests_sampling_setting_or_why_it_is_left_out():
    """SGLang's greedy is top-k 1 (it turns temperature 0 into that); its whole-vocabulary top-k is refcheck's 0; a
    penalty, or parameters refcheck's sampler refuses, are reasons."""
    from ddtree_reference.sampling import Sampling
    from refcheck.sglang.served import _sampling_of

    assert _sampling_of({"temperature": 1.0, "top_k": 1}) == Sampling()
    assert _sampling_of({"temperature": 0.5, "top_k": 1 << 30, "top_p": 0.9}) == Sampling(0.5, 0, 0.9)
    assert _sampling_of({"temperature": 0.5, "top_k": 20}) == Sampling(0.5, 20, 1.0)
    assert _sampling_of({"top_k": 1, "frequency_penalty": 0.5, "regex": "a+"}) == "frequency_penalty, regex set"
    assert _sampling_of({"temperature": 0.5, "top_k": 20, "top_p": 0.0}).startswith(
        "sampling parameters refcheck cannot take (top-p must lie in (0, 1]")


@pytest.mark.parametrize("look, value", [("lora_id", "adapter-7"), ("custom_logit_processor", True),
                                         ("input_embeds", True), ("multimodal_inputs", True),
                                         ("positional_embed_overrides", True), ("aborted", True)])
def test_a_request_with_other_weights_logits_or_prompt_than_its_ids_say_is_left_out(look, value):
    """A LoRA adapter, a custom logit processor, embeddings or images for a prompt (its ids placeholders), overridden
    positions, SGLang's abort stub (its prompt replaced): the reference, run on the token ids, cannot judge them."""
    from refcheck.sglang.served import _sampling_of

    greedy = {"temperature": 1.0, "top_k": 1, "lora_id": None, "custom_logit_processor": None, "input_embeds": None,
              "multimodal_inputs": None, "positional_embed_overrides": None, "aborted": False}
    assert _sampling_of(greedy) == Sampling()
    assert _sampling_of({**greedy, look: value}) == f"{look} set"


def test_the_first_record_keeps_the_requests_looks_beside_its_sampling_parameters():
    from refcheck.sglang.capture.contexts import params_of

    class FINISH_ABORT:  # noqa: N801 - SGLang's class name, which the reading keys on
        pass

    sp = NS(temperature=1.0, top_k=1)
    plain = params_of(NS(sampling_params=sp, lora_id=None, custom_logit_processor=None, input_embeds=None))
    assert plain is not None and plain["lora_id"] is None and plain["input_embeds"] is None and not plain["aborted"]
    odd = params_of(NS(sampling_params=sp, lora_id="a", custom_logit_processor="{...}", input_embeds=[[0.1]],
                       multimodal_inputs=object(), to_finish=FINISH_ABORT()))
    assert odd is not None and (odd["lora_id"], odd["custom_logit_processor"], odd["input_embeds"],
                                odd["multimodal_inputs"], odd["aborted"]) == ("a", "{...}", True, True, True)


@pytest.mark.parametrize("not_read, rolled_out, why", [(4, 0, "its first records before the records read"),
                                                       (0, 3, "its first records rolled out")])
def test_a_request_that_began_before_the_records_read_is_left_out(setup, not_read, rolled_out, why):
    """Reading only the latest records (``--last-records``), or a directory whose rolling budget deleted the oldest
    ones, one request's first records are not among them: it is left out and counted by why; the others are
    judged."""
    runner, prompts, trees = setup
    cap, results, rids = fake_sglang(runner, prompts, trees, "tree")
    cap = _served(cap, prompts, results, rids)
    late = rids[prompts[0].id]
    cap.prefills[0] = [p for p in cap.prefills[0] if p.rid != late]
    first = next(s for s in cap.steps[0] if s.rid == late)  # its step 0 (the fake engine records every step)
    cap.steps[0] = [s for s in cap.steps[0] if s is not first]
    cap.not_read, cap.rolled_out = not_read, rolled_out  # the records before the window, or deleted
    served = trace_of(cap, "fake")
    assert served.left_out == {why: 1}
    assert {r.request_id for r in served.assembly.trace.requests} == {rids[p.id] for p in prompts[1:]}
    stats = served.assembly.trace.provenance["capture"]["stats"]
    assert (stats.get("records_not_read", 0), stats.get("rolled_out_records", 0)) == (not_read, rolled_out)
    assert not _judge(served.assembly.trace).failures


def test_trace_import_reads_only_the_last_records_it_is_told_to(capture_dir, tmp_path, cli):
    """--last-records 1 of two batches of the same two requests: both began before it, so nothing is left to judge
    (exit 2, saying why); --last-records 0 is refused."""
    from refcheck.errors import EXIT_USAGE

    _hooks_serve(capture_dir)
    code, _, err = cli("trace", "import", str(capture_dir), "--out", str(tmp_path / "t.arrow"), "--last-records", "1")
    assert code == EXIT_USAGE and "no request refcheck can judge was recorded" in err
    assert "2 with its first records before the records read left out" in err and not (tmp_path / "t.arrow").exists()
    code, _, err = cli("trace", "import", str(capture_dir), "--out", str(tmp_path / "t.arrow"), "--last-records", "0")
    assert code == EXIT_USAGE and "--last-records takes a number of records >= 1, got 0" in err


def test_diff_capture_imports_a_servers_directory_and_diffs_it(setup, tmp_path, cli, monkeypatch):
    """`refcheck diff --capture DIR`: the directory's trace (here the fake engine's capture, read in place of the
    directory's records) is diffed, replay and free run (each request's greedy tokens as many as the trace holds of
    its output), and passes; --save-trace keeps it; with --engine, or an option of a live run the capture would
    ignore, nothing runs (exit 2)."""
    from refcheck.errors import EXIT_PASS, EXIT_USAGE
    from refcheck.sglang import served as served_module
    from refcheck.trace.io import read_trace

    runner, prompts, trees = setup
    cap, results, rids = fake_sglang(runner, prompts[:1], trees, "tree", steps=2)
    cap = _served(cap, prompts[:1], results, rids)
    (tmp_path / "status-rank0-pid1.json").write_text(json.dumps(cap.status[0]))
    monkeypatch.setattr(served_module, "read_capture", lambda root, running=False, last=None: cap)
    out = tmp_path / "served.arrow"
    code, _, err = cli("--log-level", "warning", "diff", "--capture", str(tmp_path), "--save-trace", str(out))
    assert code == EXIT_PASS, err
    kept = read_trace(out).requests
    assert [(r.request_id, r.max_new_tokens) for r in kept] == [(rids[prompts[0].id], len(kept[0].output_ids))]
    code, _, err = cli("diff", "--capture", str(tmp_path), "--engine", "reference")
    assert code == EXIT_USAGE and "give it without --engine or --against" in err
    code, _, err = cli("diff", "--capture", str(tmp_path), "--max-new-tokens", "8")
    assert code == EXIT_USAGE and "--capture takes its requests and settings from the capture directory" in err
    code, _, err = cli("diff", "--running", "--last-records", "5")
    assert code == EXIT_USAGE and "--running, --last-records: only with --capture DIR" in err
    seen = {}
    monkeypatch.setattr(served_module, "read_capture", lambda root, running=False, last=None:
                        seen.update(running=running, last=last) or cap)
    code, _, err = cli("--log-level", "warning", "diff", "--capture", str(tmp_path), "--mode", "replay", "--running",
                       "--last-records", "5")
    assert code == EXIT_PASS and seen == {"running": True, "last": 5}, err


def test_data_parallel_replicas_may_each_have_a_rank_0(capture_dir):
    """Two scheduler processes recorded as rank 0: two engines in one directory (a capture error), unless the
    server's arguments say it runs two data-parallel replicas, whose requests join by rid."""
    import shutil

    from refcheck.sglang.capture.records import read_capture

    _hooks_serve(capture_dir)
    first = next(capture_dir.glob("rank0-pid*"))
    shutil.copytree(first, capture_dir / "rank0-pid999999")
    status = json.loads(next(capture_dir.glob("status-rank0-pid*.json")).read_text())
    (capture_dir / "status-rank0-pid999999.json").write_text(json.dumps(status))
    assert any("2 scheduler processes" in e and "cannot be told apart" in e for e in read_capture(capture_dir).errors)
    for f in capture_dir.glob("status-rank0-pid*.json"):
        f.write_text(json.dumps({**status, "server": {**status["server"], "dp_size": 2}}))
    assert not [e for e in read_capture(capture_dir).errors if "cannot be told apart" in e]


@pytest.mark.parametrize("when", ["listed", "scanned"])
def test_a_segment_a_running_servers_rolling_budget_deletes_mid_read_is_passed_over(capture_dir, monkeypatch, when):
    """A running server with a rolling budget deletes its oldest segment after the directory's listing (before its
    frames are scanned, or once they were): read with ``running``, passed over; read as a stopped server's
    directory, an error."""
    from refcheck.sglang.capture import records, segments
    from refcheck.sglang.capture.segments import segment_files

    _hooks_serve(capture_dir)
    first = segment_files(next(capture_dir.glob("rank0-pid*")), "records")[0]
    module, name = (segments, "scan") if when == "listed" else (records, "payloads")
    real = getattr(module, name)

    def gone(path, *args):
        if path == first:
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real(path, *args)

    monkeypatch.setattr(module, name, gone)
    assert not records.read_capture(capture_dir, running=True).errors
    assert any("segment gone while the directory was read" in e for e in records.read_capture(capture_dir).errors)


def test_requests_the_schedulers_met_that_no_record_holds_are_counted(setup):
    """A sampled server's request that ends at its prefill, the rule passing over that one batch, is in no record: the
    schedulers' ledgers count it among the requests they met, and the trace says so; every recorded request is
    judged. When the ledgers' count equals the recorded requests (or no ledger counted), nothing is said."""
    runner, prompts, trees = setup
    cap, results, rids = fake_sglang(runner, prompts, trees, "tree")
    cap = _served(cap, prompts, results, rids)
    cap.requests_met = len(prompts) + 2
    served = trace_of(cap, "fake")
    assert served.left_out == {UNRECORDED: 2}
    assert served.assembly.trace.provenance["engine"]["settings"]["left_out"] == {UNRECORDED: 2}
    assert {r.request_id for r in served.assembly.trace.requests} == {rids[p.id] for p in prompts}
    for met in (len(prompts), 0):
        cap.requests_met = met
        assert not trace_of(cap, "fake").left_out
